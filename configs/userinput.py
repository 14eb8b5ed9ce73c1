"""What a person typed or named, made safe to quote and to read: short escaped quotes for one-line messages,
files that must be regular files of a bounded size, a folder in the temp folder that is this user's alone, and
command lines whose errors are one line. Every entry point and package opens a user's small file (a config, a
prompt) and quotes a user's value through here."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import reprlib
import shlex
import stat
import sys
import tempfile
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .values import NEAR_ZERO, near_zero

# Characters of a value quoted in a message: enough to recognise it, never enough to flood a terminal.
QUOTE_LIMIT = 80
ERROR_LIMIT = 400  # the most of an argparse error line quoted (its own message, with the value it refused)

_repr = reprlib.Repr()
_repr.maxstring = QUOTE_LIMIT
_repr.maxother = QUOTE_LIMIT
_repr.maxlist = _repr.maxtuple = _repr.maxset = _repr.maxdict = 6
_repr.maxlevel = 3


def shown(value: object, limit: int = QUOTE_LIMIT) -> str:
    """value as a one-line message may quote it: text escaped (a newline or control character cannot split the
    line) and cut to about limit characters with '...' in its middle; anything else through a bounded repr, so a
    small YAML file whose aliases build a huge nested value cannot make a huge message.

    Text keeps its start and, longer, its end: the end of a path names the file (a corpus deep in a temp folder,
    '/var/folders/.../T/run/corpus.txt', reads as which file it is, where a cut end would lose it)."""
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, bytes):
            text = text.decode("utf-8", "backslashreplace")
        escaped = text if text.isprintable() else repr(text)[1:-1]
        if len(escaped) <= limit:
            return escaped
        head = max(limit // 3, 1)
        return escaped[:head] + "..." + escaped[len(escaped) - max(limit - head - 3, 1):]
    text = _repr.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# How bash's $'...' writes the control characters that have a letter of their own.
_BASH_ESCAPES = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r",
                 "\x1b": "\\e"}


def shell_word(text: str) -> str:
    """text as one word of a command line that a person pastes back into a shell, on one line and exact.

    Printable text takes shlex.quote's form ('my runs/a'). Text with a control character (a newline in a folder's
    name) takes bash's $'...', where each such character is escaped: by its letter (\\n) or as its bytes (\\xHH, in
    UTF-8, and a byte that was not UTF-8 as itself), which mean the same bytes whatever the shell's locale."""
    if text.isprintable():
        return shlex.quote(text)
    parts = []
    for ch in text:
        if ch in "\\'":
            parts.append("\\" + ch)
        elif ch in _BASH_ESCAPES:
            parts.append(_BASH_ESCAPES[ch])
        elif ch.isprintable():
            parts.append(ch)
        else:  # os.fsencode's bytes: a lone surrogate is a byte a path held that was not UTF-8
            parts.extend(f"\\x{byte:02x}" for byte in os.fsencode(ch))
    return "$'" + "".join(parts) + "'"


def shows_nothing_alone(ch: str) -> bool:
    """Whether a character draws nothing of its own: a combining mark (an accent, a Devanagari vowel sign, which
    sits on whatever comes before it, a quote mark in a message) or an invisible one (U+200D, the joiner of emoji)."""
    return unicodedata.category(ch) in ("Mn", "Mc", "Me", "Cf")


def path_word(path: str) -> str:
    """A path as one word of a command line (shell_word), written ./-x where it starts with '-', which a command
    would take for an option: `sample.py --out-dir -x` was "expected one argument", `cp -x/best.pt ...` a bad flag."""
    return shell_word(f"./{path}" if path.startswith("-") else path)


# The project's folder, where train.py and sample.py are.
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_word(name: str) -> str:
    """How to name the project's script name (train.py, sample.py) in a command run from the current folder: as is
    from the project's folder, else by its path. A run started as `python tinychar/train.py` printed `python
    sample.py ...`, which no file answered where the person was."""
    path = os.path.join(_PROJECT, name)
    try:
        relative = os.path.relpath(path)
    except (OSError, ValueError):  # the current folder is gone; another drive (Windows)
        relative = path
    return path_word(path if relative.startswith("..") else relative)


def file_kind(mode: int) -> str | None:
    """What a file of this st_mode is, in words, when it is not a regular file (None for a regular file)."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe (a FIFO, or <(command) in a shell)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), None)


def _kind_of(path: str | Path) -> str | None:
    try:
        return file_kind(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def not_stdin(what: str) -> str:
    """The line for '-' given as the file to read: many tools read standard input for it, and "no such file '-'" did
    not say that this one reads files alone."""
    return f"{what} reads a file, not standard input ('-'); save the text in a file and give its path"


def read_user_file(
    path: str | Path, what: str, max_bytes: int, error: type[Exception] = ValueError, own: bool = False
) -> bytes:
    """The bytes of the regular file a person named as `what` (such as '--prompt-file'), at most max_bytes of them.

    Anything else is refused with one line raised as `error`: a missing file, a folder, a pipe or device (which
    could be read forever, like /dev/zero), a file over the limit, or one the system will not open (permissions, a
    name too long). The size is checked on the open file, and the read stops past the limit whatever the size said.
    With own, a file that another user owns is refused too (checked on the open file, so it cannot be swapped after).
    """
    name = shown(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO with no writer must not block
    except FileNotFoundError:
        raise error(not_stdin(what) if str(path) == "-" else f"{what}: no such file '{name}'") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL character in the path
        kind = _kind_of(path)  # a socket cannot be opened at all ("no such device or address")
        if kind is not None:
            raise error(f"{what}: '{name}' is {kind}, not a file; give the path of a regular file") from None
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise error(f"{what}: cannot open '{name}' ({reason})") from None
    try:
        st = os.fstat(fd)  # on the descriptor, before wrapping it: a folder cannot be wrapped in a file object
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise error(f"{what}: '{name}' is {kind}, not a file; give the path of a regular file")
        if st.st_size > max_bytes:
            raise error(f"{what}: '{name}' is {st.st_size:,} bytes; the limit is {max_bytes:,}: give a smaller file")
        if own and hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise error(f"{what}: '{name}' belongs to another user; remove it or give a file of your own")
        with os.fdopen(fd, "rb") as f:
            fd = -1  # the file object closes it now
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{what}: cannot read '{name}' ({e.strerror or e})") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:  # it grew while being read
        raise error(f"{what}: '{name}' is over the limit of {max_bytes:,} bytes: give a smaller file")
    return data


def temp_root() -> Path:
    """tinychar's folder in the temp folder, one per user: where its caches go when the user's own cannot be used."""
    return Path(tempfile.gettempdir()) / f"tinychar-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def temp_root_problem(root: Path | None = None) -> str | None:
    """Why temp_root() cannot be trusted with this user's caches, in words, or None: missing, or a folder this user
    owns that no one else can write. Its name is known to all, so another user could have made it first, or a link
    by that name, and put there compiled libraries or data that this user's runs would then load."""
    root = temp_root() if root is None else root
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"'{shown(str(root))}' cannot be read ({e.strerror or type(e).__name__})"
    if stat.S_ISLNK(st.st_mode):
        return f"'{shown(str(root))}' is a symbolic link, not this user's own folder"
    if not stat.S_ISDIR(st.st_mode):
        return f"'{shown(str(root))}' is {file_kind(st.st_mode) or 'a file'}, not a folder"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"'{shown(str(root))}' belongs to another user"
    if st.st_mode & 0o022:
        return f"others can write in '{shown(str(root))}'"
    return None


def private_temp_root() -> Path:
    """temp_root(), made for this user alone (mode 0700) where it is missing; PermissionError, saying why, where it
    cannot be trusted (temp_root_problem)."""
    root = temp_root()
    root.parent.mkdir(parents=True, exist_ok=True)  # the temp folder itself, should $TMPDIR name a missing one
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    if (why := temp_root_problem(root)) is not None:  # checked after making it: no one can slip one in between
        raise PermissionError(errno.EACCES, f"{why}; remove it")
    return root


class StoreOnce(argparse._StoreAction):
    """argparse's plain store of a path, refusing a second, different one (argparse keeps the last): for an option
    whose second value reads as something else than a replacement, as `--config a.yaml --config b.yaml` might read as
    layered configs, where it trained on b alone without a word. One file named twice (a.yaml, ./a.yaml) is one
    request."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204 - argparse's own
        given = getattr(parser, "_given", {})
        if self.dest in given and os.path.realpath(given[self.dest]) != os.path.realpath(values):
            raise argparse.ArgumentError(self, f"given twice, as '{shown(given[self.dest])}' and '{shown(values)}'; "
                                               f"give it once{getattr(self, 'once_hint', '')}")
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


def real(text: str, zero_means: str = "") -> float:
    """A float from the command line (an argparse type), as a config's reals are read: refused with the text cut to
    its ends, and where it spells a number nearer 0 than a float can hold (1e-400), which float() reads as 0 without
    a word; zero_means, what 0 does for this option, is added to that refusal."""
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{shown(text)}'") from None
    if near_zero(text, number):
        raise argparse.ArgumentTypeError(f"{shown(text)} {NEAR_ZERO}{zero_means}")
    return number


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line gets one line on stderr (and exit status 2), not usage plus error."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's own signature
        self._argv = list(sys.argv[1:] if args is None else args)  # for error(): what the option was followed by
        self._given: dict[str, object] = {}  # each StoreOnce option's value, as given on this command line
        return super().parse_known_args(args, namespace)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]):  # noqa: ANN202 - argparse's own
        # --prompt=-- (what _dash_hint advises for a prompt of '--'): Python 3.11's argparse drops the '--' as the end
        # of options and gives the option [], past its type and choices: a traceback, or (--out-dir=--) the default
        # run sampled without a word. A value after '=' is the option's value, whatever it is.
        if action.nargs is None and action.option_strings and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)

    # For an unrecognized argument: argv -> '; how to write it' or '' (train.py: a setting written as an option)
    unknown_hint: Callable[[list[str]], str] | None = None

    def error(self, message: str) -> NoReturn:
        # argparse quotes what it refuses whole: a value thousands of characters long stays one short line
        hint = self._dash_hint(message)
        if not hint and self.unknown_hint is not None and message.startswith("unrecognized arguments"):
            hint = self.unknown_hint(getattr(self, "_argv", []))
        self.exit(2, f"error: {shown(message, ERROR_LIMIT)}{hint} (see {self.prog} --help)\n")

    def _dash_hint(self, message: str) -> str:
        """For an option whose value starts with '-' (--prompt -ROMEO, --temperature -1e-3), which argparse takes
        for an option and so says the value is missing: how to give it."""
        found = re.fullmatch(r"argument (-[-\w]+)(?:/-[-\w]+)*: expected one argument", message)
        argv = getattr(self, "_argv", [])
        if found is None or found.group(1) not in argv:
            return ""
        at = argv.index(found.group(1))
        if at + 1 >= len(argv) or not argv[at + 1].startswith("-"):
            return ""
        word = shell_word(f"{found.group(1)}={argv[at + 1]}")
        return f"; a value that starts with '-' goes after '=', as in {word if len(word) <= 60 else word[:57] + '...'}"


def path_kind(path: str | Path) -> str | None:
    """What path is when it is not a regular file, such as 'a folder' (None for a file, or for a path that cannot be
    looked at, whose reason read_user_file gives). read_user_file refuses the others as well, but a folder makes its
    os.fdopen raise IsADirectoryError, and a socket cannot be opened to be named."""
    try:
        return file_kind(os.stat(path).st_mode)
    except (OSError, ValueError):  # ValueError: a NUL character in the path
        return None


def resolved(path: str | Path) -> Path:
    """Path(path).resolve(), the file that path's links lead to, where a loop of symbolic links on the way raises
    OSError with errno ELOOP on every Python: 3.11 and 3.12 raise RuntimeError for it, and 3.13 gives such a path back
    as it is (a loop named 'out.png' would pass for a new file of that name). Nothing there yet (a file still to be
    written) or another reason it cannot be looked at resolves as Path.resolve does."""
    p = Path(path)
    try:
        try:
            return p.resolve(strict=True)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise
        return p.resolve()
    except RuntimeError:  # 3.11 and 3.12: "Symlink loop from ..."
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None
