"""Where a run keeps its checkpoints, and the error every checkpoint problem raises: found without torch, so that
sample.py names a run folder that is not there before it spends seconds importing torch (model.checkpoint reads the
checkpoint itself)."""

from __future__ import annotations

import shlex
from pathlib import Path

# Where --overwrite keeps the old run until the new one has a checkpoint (training.outdir), and so where a run killed
# before then leaves it: a resume continues it from there, and sample.py --out-dir points to it.
ASIDE = ".replaced"
# Where the old run's files gather on their way into ASIDE, and out of it: a folder renamed whole, so that a kill
# midway never leaves the old run split between out_dir and ASIDE (training/outdir.py).
MOVING_ASIDE, MOVING_BACK = ".replacing", ".restoring"
ASIDE_FOLDERS = (ASIDE, MOVING_ASIDE, MOVING_BACK)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line for a person."""


# Characters of a path that a message quotes, as configs.userinput.shown quotes one for the rest of tinychar (this
# package imports only torch, and this module not even that): enough to recognise it, its start and its end, where
# the file's name is.
PATH_LIMIT = 80


def quoted(path: str | Path) -> str:
    """path in single quotes for a one-line message: escaped (a newline in a name cannot split the line) and, past
    PATH_LIMIT characters, cut in its middle."""
    text = str(path)
    text = text if text.isprintable() else repr(text)[1:-1]
    if len(text) > PATH_LIMIT:
        head = PATH_LIMIT // 3
        text = text[:head] + "..." + text[len(text) - (PATH_LIMIT - head - 3):]
    return f"'{text}'"


def command_word(path: str | Path) -> str:
    """path as one word of a command that a person pastes back into a shell: all of it (a path cut as quoted() cuts
    it names no file), in shlex's quotes, with ./ before a leading '-', which the command would take for an option.
    A name with a control character in it has no such word on one line: FILE stands for it there."""
    text = str(path)
    if not text.isprintable():
        return "FILE"
    return shlex.quote(f"./{text}" if text.startswith("-") else text)


def find_checkpoint(out_dir: str | Path) -> Path:
    """The checkpoint to sample from in a run folder: best.pt, else ckpt.pt."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise CheckpointError(f"no run folder {quoted(out_dir)}; train one with `python train.py` or pass "
                              f"--checkpoint FILE")
    for name in ("best.pt", "ckpt.pt"):
        # a link that leads nowhere is found too, and load_checkpoint says so: passed over, it read as "holds no
        # best.pt or ckpt.pt", or a best.pt in a loop of links gave way to ckpt.pt without a word
        if (out_dir / name).exists() or (out_dir / name).is_symlink():
            return out_dir / name
    for name in ("best.pt", "ckpt.pt"):  # an --overwrite run stopped before its first checkpoint, or still before it
        for folder in ASIDE_FOLDERS:
            if (out_dir / folder / name).exists():
                raise CheckpointError(f"{quoted(out_dir)} holds no best.pt or ckpt.pt of its own: the run that an "
                                      f"--overwrite replaced waits in {quoted(out_dir / folder)}; sample from it with "
                                      f"--checkpoint {command_word(out_dir / folder / name)}")
    raise CheckpointError(f"{quoted(out_dir)} holds no best.pt or ckpt.pt; train first with `python train.py`")


def check_checkpoint_path(path: Path) -> None:
    """CheckpointError when nothing is at path, a link leads nowhere, or path is a folder: what can be said of a
    checkpoint before torch is imported (model.checkpoint.load_checkpoint says the rest)."""
    if not path.exists():
        if path.is_symlink():  # exists() follows the link: it leads nowhere, or round in a loop
            raise CheckpointError(f"{quoted(path)} is a symbolic link that leads to no file (its target is missing, or "
                                  f"the links go round in a loop); give the checkpoint's own path")
        raise CheckpointError(f"no checkpoint at {quoted(path)}; train one first with `python train.py`")
    if path.is_dir():
        raise CheckpointError(f"{quoted(path)} is a folder, not a checkpoint file; name the checkpoint in it "
                              "(ckpt.pt, or best.pt)")
