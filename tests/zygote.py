"""The tests' real train.py, sample.py and bench.py processes, started without paying for torch's import each time.

Half the suite's CPU time went into the processes it starts, and most of that into `import torch` (1.5 s each on a
2-core machine). A test that starts `[sys.executable, SCRIPT, ...]` with subprocess now gets, instead of a new
interpreter, a fork of a zygote: a process of this test worker that started as `python zygote.py`, imported torch and
nothing of tinychar's, and waits. The fork is made a child of the test's process (which is a child subreaper while the
zygote's go-between exits), so Popen waits for it, signals it and reads its pipes as it would a process it had exec'd.
The fork sets itself up as the interpreter would: standard streams, working folder, environment, umask, session,
ignored signals, signal mask and resource limits; then a new `__main__` module runs the script's file, with
`sys.argv` and `sys.path[0]` as `python SCRIPT` gives them. Exit status, tracebacks and a Ctrl-C's self-kill come from
the interpreter's own top level. Measured (sample.py, 50 characters, six of each interleaved, medians): 0.38 s forked,
1.65 s exec'd; a process that refuses its input before importing torch takes 0.23-0.26 s forked, 0.09-0.13 s exec'd.

Only what cannot tell the difference goes this way; anything else is exec'd as before: another program or script, an
option to the interpreter (`-c`, `-m`, `-X importtime`: the tests of what a process imports before refusing, and of
signals while torch loads, use those), a preexec_fn other than `limits`'s, pass_fds, close_fds=False, another user,
an environment that differs from the zygote's in anything read while torch loads (only _READ_LATER's may differ), and
the tests marked `no_zygote`. What is lost: the forks share their zygote's string hash seed, and torch was imported
before the script began, not where the script imports it. TINYCHAR_TEST_ZYGOTE=0 runs the suite with every process
exec'd.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("train.py", "sample.py", "bench.py")
# Environment variables read when a program uses them, not while torch loads: a child's may differ from the zygote's.
_READ_LATER_PREFIXES = ("TINYCHAR_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "XDG_", "PYTEST_", "TORCHELASTIC_")
_READ_LATER = {"HOME", "TMPDIR", "PATH", "PWD", "OLDPWD", "COLUMNS", "LINES", "TERM", "RANK", "LOCAL_RANK",
               "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
_PR_SET_CHILD_SUBREAPER = 36
_MESSAGE = 1 << 20
_COMPILED: dict[str, tuple[int, int, types.CodeType]] = {}  # path: (mtime_ns, size, code)


def _read_later(key: str) -> bool:
    return key.startswith(_READ_LATER_PREFIXES) or key in _READ_LATER


class Zygote:
    """The client side, in the test's process: one zygote, started at the first process it can start."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.process: subprocess.Popen | None = None
        self.broken = False
        self.off = False  # for a test whose subject is the interpreter's start (the `no_zygote` mark)
        self.limits = _limits()

    def _start(self) -> socket.socket | None:
        if self.sock is None and not self.broken:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.settimeout(120)  # its import, then a fork: seconds at most
            log = open(os.path.join(self.env.get("TMPDIR", "/tmp"), f"zygote-{os.getpid()}.log"), "ab")  # noqa: SIM115
            with log:
                self.process = subprocess.Popen(
                    [sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()], cwd=ROOT,
                    env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            theirs.close()
            self.sock = ours
        return self.sock

    def job(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, shell, restore_signals, gid, gids, uid,
            umask, start_new_session, process_group) -> dict | None:
        """What the fork must become, or None where only an exec'd process will do."""
        rlimits = getattr(preexec_fn, "rlimits", None) if preexec_fn is not None else {}
        if (self.off or shell or rlimits is None or not close_fds or pass_fds or not restore_signals
                or (gid, gids, uid) != (None, None, None) or executable not in (None, sys.executable)
                or isinstance(args, (str, bytes)) or len(args) < 2 or os.fsdecode(args[0]) != sys.executable):
            return None
        where = os.path.abspath(os.fsdecode(cwd) if cwd is not None else os.getcwd())
        script = os.path.join(where, os.fsdecode(args[1]))
        if not (os.path.dirname(os.path.abspath(script)) == str(ROOT) and os.path.basename(script) in SCRIPTS
                and os.path.realpath(script) == os.path.abspath(script) and os.path.isfile(script)):
            return None
        if env is None:
            env = dict(os.environ)
        if any(not isinstance(k, str) or not isinstance(v, str) for k, v in env.items()):
            return None
        if any(env.get(k) != self.env.get(k) for k in {*env, *self.env} if not _read_later(k)):
            return None
        if _limits() != self.limits:
            return None
        ignored = [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                   and signal.getsignal(s) == signal.SIG_IGN and s not in (signal.SIGPIPE, signal.SIGXFSZ)]
        return {"argv": [os.fsdecode(a) for a in args], "script": os.path.abspath(script), "cwd": where, "env": env,
                "umask": umask, "setsid": start_new_session, "pgid": process_group, "ignored": ignored,
                "mask": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])], "rlimits": rlimits}

    def spawn(self, job: dict, fds: list[int]) -> int | None:
        """The pid of a fork become the job, now a child of this process; None if the zygote cannot give one."""
        with self.lock:
            sock = self._start()
            if sock is None:
                return None
            _subreaper(True)
            try:
                socket.send_fds(sock, [pickle.dumps(job)], fds)
                reply = sock.recv(_MESSAGE)
            except OSError:
                reply = b""
            finally:
                _subreaper(False)
            pid = pickle.loads(reply) if reply else None
            if not pid:
                self.broken = True
            return pid or None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.process.wait()


def _limits() -> list[tuple[int, int]]:
    import resource

    return [resource.getrlimit(getattr(resource, name)) for name in
            ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_STACK", "RLIMIT_CORE")]


def limits(rlimits: dict[int, tuple[int, int]]) -> Callable[[], None]:
    """A preexec_fn that sets these resource limits in the child, which a fork from the zygote sets too."""
    import resource

    def preexec() -> None:
        for which, values in rlimits.items():
            resource.setrlimit(which, values)

    preexec.rlimits = dict(rlimits)
    return preexec


def _subreaper(on: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def install(env: dict[str, str]) -> Zygote | None:
    """Make subprocess start the scripts as forks of a zygote started with env; None where it cannot (not Linux)."""
    if not sys.platform.startswith("linux") or os.environ.get("TINYCHAR_TEST_ZYGOTE", "1") == "0":
        return None
    zygote = Zygote(env)
    original = subprocess.Popen._execute_child

    def execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                      shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                      umask, start_new_session, process_group):
        job = zygote.job(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, shell, restore_signals, gid, gids,
                         uid, umask, start_new_session, process_group)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        pid = zygote.spawn(job, fds) if job is not None else None
        if pid is None:
            return original(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                            creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                            restore_signals, gid, gids, uid, umask, start_new_session, process_group)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        return None

    subprocess.Popen._execute_child = execute_child
    return zygote


# --- the zygote's side


def _serve(fd: int):
    """Wait for jobs; return only in a fork that is to become one (job, its three standard streams)."""
    sock = socket.socket(fileno=fd)
    import torch  # noqa: F401  the point of the zygote

    _compile_ahead()
    gc.freeze()  # torch's objects out of the forks' collections: a fork's exit took 0.55 s, 0.20 s with this

    alone = len(os.listdir("/proc/self/task")) == 1  # forking a process with threads could copy a held lock
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)
        if not alone or len(fds) != 3:
            for f in fds:
                os.close(f)
            sock.send(pickle.dumps(None))
            continue
        go_read, go_write = os.pipe()
        pid_read, pid_write = os.pipe()
        middle = os.fork()
        if middle == 0:
            try:
                child = os.fork()
            except BaseException:
                os._exit(1)
            if child:
                os.write(pid_write, b"%d" % child)
                os._exit(0)
            os.close(go_write)
            os.read(go_read, 1)  # until the go-between has gone and this process is the test process's child
            sock.detach()
            return pickle.loads(message), fds
        for f in (*fds, pid_write, go_read):
            os.close(f)
        pid = int(os.read(pid_read, 32) or b"0")
        os.close(pid_read)
        os.waitpid(middle, 0)
        if pid:
            os.write(go_write, b"g")
        os.close(go_write)
        sock.send(pickle.dumps(pid))


def _project_files() -> list[str]:
    """The project's own Python files, which a fork imports or runs."""
    return [str(path) for pattern in ("*.py", "*/*.py", "*/*/*.py") for path in ROOT.glob(pattern)
            if path.parts[len(ROOT.parts)] not in ("tests", ".ci-venv", ".venv", "venv")]


def _compile_ahead(paths: list[str] | None = None) -> dict[str, tuple[int, int, types.CodeType]]:
    """Compile the project's files once, here, so that each fork takes their code instead of compiling them again: a
    fork imports some seventy of them, 0.1 s of compiling where the bytecode is not cached on disk
    (PYTHONDONTWRITEBYTECODE, as on this project's CI machine) of its 0.4 s. A fork takes a file's code only while
    the file's size and modification time are those compiled (cached_code); else Python reads it as usual."""
    import importlib.machinery

    compiled = {}
    for path in paths if paths is not None else _project_files():
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                source = f.read()
            code = compile(source, path, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError):
            continue  # Python says what is wrong with it when a fork imports it
        compiled[path] = (stat.st_mtime_ns, stat.st_size, code)
    _COMPILED.clear()
    _COMPILED.update(compiled)
    loader = importlib.machinery.SourceFileLoader
    if not getattr(loader.get_code, "zygote", False):
        original = loader.get_code

        def get_code(self, fullname):
            code = cached_code(self.get_filename(fullname))
            return code if code is not None else original(self, fullname)

        get_code.zygote = True
        loader.get_code = get_code
    return compiled


def cached_code(path: str) -> types.CodeType | None:
    """The code _compile_ahead compiled for path if the file is still as it was then, else None."""
    entry = _COMPILED.get(path)
    if entry is None:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return entry[2] if (stat.st_mtime_ns, stat.st_size) == entry[:2] else None


def _stream(fd: int, like, writing: bool):
    import io

    buffered = open(fd, "wb" if writing else "rb", closefd=False)  # noqa: SIM115  as the interpreter opens them
    text = io.TextIOWrapper(buffered, encoding=like.encoding, errors=like.errors, newline="\n",
                            line_buffering=writing and (buffered.isatty() or fd == 2))
    text.mode = "w" if writing else "r"
    return text


def _become(job: dict, fds: list[int]) -> dict:
    """Set this fork up as `python SCRIPT ARGS` would start; the namespace to run the script in."""
    import importlib.machinery
    import random
    import tempfile
    import types

    for target, f in enumerate(fds):
        os.dup2(f, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    if job["umask"] >= 0:
        os.umask(job["umask"])
    if job["setsid"]:
        os.setsid()
    elif job["pgid"] >= 0:
        os.setpgid(0, job["pgid"])
    for s in job["ignored"]:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, job["mask"])
    if job["rlimits"]:
        import resource

        for which, values in job["rlimits"].items():
            resource.setrlimit(which, values)
    random.seed()
    tempfile.tempdir = None
    sys.stdin = sys.__stdin__ = _stream(0, sys.stdin, False)
    sys.stdout = sys.__stdout__ = _stream(1, sys.stdout, True)
    sys.stderr = sys.__stderr__ = _stream(2, sys.stderr, True)
    sys.argv = job["argv"][1:]
    sys.orig_argv = list(job["argv"])
    sys.path[0] = os.path.dirname(job["script"])
    main = types.ModuleType("__main__")
    main.__file__ = job["script"]
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", job["script"])
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    return main.__dict__


if __name__ == "__main__":
    _job, _fds = _serve(int(sys.argv[1]))
    _namespace = _become(_job, _fds)
    _code = cached_code(_job["script"])
    if _code is None:
        with open(_job["script"], "rb") as _file:
            _code = compile(_file.read(), _job["script"], "exec", dont_inherit=True)  # as the interpreter does
        del _file
    del _job, _fds
    exec(_code, _namespace)
