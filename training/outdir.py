"""A run's out_dir: the checks before a run may use the folder, claiming it (under its lock), and --overwrite, which
moves the old run aside and deletes it only once the new run has saved its first checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from configs import to_dict
from configs.errors import UsageError
from configs.userinput import shown

# ASIDE: where --overwrite keeps the old run; the other two, where its files gather on their way there and back
from model.runs import ASIDE, ASIDE_FOLDERS, MOVING_ASIDE, MOVING_BACK

from .atomic import write_atomic
from .config import CONFIG_MARK, RunConfig
from .lock import LOCK, RunLock, file_identity, in_use

# Temporary files that an atomic write killed midway leaves behind (see write_atomic).
STALE_TEMPORARY = (".ckpt.pt.*.tmp", ".best.pt.*.tmp", ".config.yaml.*.tmp")


def _run_files(out_dir: Path) -> list[Path]:
    """What --overwrite replaces: the checkpoints, the resolved config and the TensorBoard logs."""
    named = [out_dir / name for name in ("ckpt.pt", "best.pt", "config.yaml")]
    return [p for p in named if p.exists()] + sorted(out_dir.glob("events.out.tfevents.*"))


def prepare_out_dir(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a folder a live run holds, a finished run without --resume or --overwrite, and a file in the way."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"out_dir '{shown(str(out_dir))}' exists and is not a folder; choose another out_dir")
    if out_dir.is_symlink() and not out_dir.exists():  # claiming it said "File exists", of nothing there
        raise UsageError(f"out_dir '{shown(str(out_dir))}' is a symbolic link that leads nowhere (to "
                         f"'{shown(os.readlink(out_dir))}', which is missing, or round a loop of links); make the "
                         f"folder it names, or choose another out_dir")
    if holder := RunLock(out_dir).busy():
        raise in_use(out_dir, holder)
    for folder in ASIDE_FOLDERS:
        if foreign := not_aside(out_dir, folder):
            raise UsageError(f"'{shown(str(out_dir / folder))}' holds what no --overwrite put there ({foreign}), and a "
                             f"run replaces or empties that folder; move it out of out_dir, or choose another out_dir")
    if not_a_runs_config(out_dir):
        raise UsageError(f"'{shown(str(out_dir / 'config.yaml'))}' is not a config.yaml that tinychar wrote, and this "
                         f"run would replace it with its own; move it out of the folder, or choose another out_dir")
    if resume:
        best = out_dir / "best.pt"
        if best.is_dir() and not best.is_symlink():  # found only when the first better step came to be saved
            raise UsageError(f"'{shown(str(best))}' is a folder, where this run keeps its best checkpoint; move it out "
                             f"of out_dir, then --resume again")
        return
    # --overwrite moved a folder under a run file's name aside with the old run's files and deleted it with them; a
    # new run told that a best.pt folder was a run to continue or to --overwrite (a config.yaml is refused below)
    if folders := [p for p in _run_files(out_dir) if p.is_dir() and not p.is_symlink()
                   and (overwrite or p.name != "config.yaml")]:
        raise UsageError(f"'{shown(str(folders[0]))}' is a folder, where a run keeps a file of its own; move it out of "
                         f"out_dir, or choose another out_dir")
    # .replaced/ckpt.pt (or best.pt alone): left by an --overwrite killed midway, which claiming out_dir puts back
    existing = [p for p in (out_dir / "ckpt.pt", out_dir / "best.pt", *(out_dir / f / name for name in ("ckpt.pt",
                "best.pt") for f in ASIDE_FOLDERS)) if p.exists()]
    if existing and not overwrite:
        held = existing[0].relative_to(out_dir).as_posix()
        raise UsageError(f"'{shown(str(out_dir))}' already holds a run ({held}); continue it with --resume, choose "
                         f"another out_dir=..., or start afresh with --overwrite")


def not_aside(out_dir: Path, folder: str = ASIDE) -> str:
    """The first few entries of out_dir/folder (.replaced, or one the old run's files pass through) that are no run
    file --overwrite moved there, named; '' if there are none (or no such folder). A person's .replaced/ was emptied
    into out_dir, or deleted by the next --overwrite."""
    try:
        names = sorted(os.listdir(out_dir / folder))
    except OSError:  # none, or not a folder (claiming out_dir says so)
        return ""
    foreign = [n for n in names if n not in ("ckpt.pt", "best.pt", "config.yaml")
               and not n.startswith("events.out.tfevents.")]
    return ", ".join(shown(n, 40) for n in foreign[:3]) + (" ..." if len(foreign) > 3 else "")


def not_a_runs_config(out_dir: Path) -> bool:
    """Whether out_dir/config.yaml is a file no run wrote: it lacks CONFIG_MARK and nothing else in out_dir is a
    run's (a run folder has .lock from its first moment, runs written before the mark included)."""
    config = out_dir / "config.yaml"
    if not config.is_file() or any((out_dir / name).exists() for name in (LOCK, "ckpt.pt", "best.pt", *ASIDE_FOLDERS)):
        return False
    try:
        with config.open("rb") as f:
            return f.readline(len(CONFIG_MARK)) != CONFIG_MARK
    except OSError:  # unreadable: not known to be a run's
        return True


def changed_since_checked(out_dir: Path, *, resume: bool, overwrite: bool, loaded: tuple | None) -> str | None:
    """Why out_dir no longer is as prepare_out_dir found it, now that this run holds its lock: another run saved into
    it while this one read its corpus and built its model (minutes, for a large corpus's first encoding), and this
    run would write over that one's checkpoints. loaded: the file_identity of the ckpt.pt a resume loaded. None if
    nothing changed."""
    if resume:
        if loaded is not None and file_identity(out_dir / "ckpt.pt") != loaded:
            return (f"'{shown(str(out_dir / 'ckpt.pt'))}' was replaced by another run while this one was starting, "
                    f"and this run would write over its steps; resume again to continue from the new one")
        return None
    held = [name for name in ("ckpt.pt", "best.pt") if (out_dir / name).exists()]
    if overwrite or not held:
        return None
    return (f"'{shown(str(out_dir))}' now holds a run ({held[0]}) that another run saved while this one was "
            f"starting; continue it with --resume, choose another out_dir=..., or start afresh with --overwrite")


def claim_out_dir(out_dir: Path, cfg: RunConfig, *, resume: bool, overwrite: bool,
                  loaded: tuple | None = None) -> tuple[RunLock, str | None]:
    """Make out_dir this run's (rank 0 alone, once every check has passed): take the lock, check that no other run
    saved into out_dir since the checks (loaded: see changed_since_checked), put back a run that an interrupted
    --overwrite left aside, clear what a killed writer left, move the old run aside on --overwrite, and write the
    resolved config.yaml. Returns the lock (held until released) and a line saying what --overwrite replaced, if
    anything."""
    lock, replaced = RunLock(out_dir), None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        recover_aside(out_dir)
        if why := changed_since_checked(out_dir, resume=resume, overwrite=overwrite, loaded=loaded):
            raise UsageError(why)
        for pattern in STALE_TEMPORARY:  # this run owns out_dir now; no other writer can be midway
            for stale in out_dir.glob(pattern):
                stale.unlink(missing_ok=True)
        replaced = move_aside(out_dir) if overwrite and not resume else None
        resolved = CONFIG_MARK + yaml.safe_dump(to_dict(cfg), sort_keys=False).encode("utf-8")
        write_atomic(out_dir / "config.yaml", lambda f: f.write(resolved))
    except UsageError:  # before ValueError, which it is: the lock's refusal says all there is to say
        lock.release()
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL character in the path
        back = ""
        if replaced is not None:  # config.yaml failed (a full disk): the old run goes back before the lock goes
            try:
                restore_aside(out_dir)
                back = "; the run it was replacing is back in place"
            except OSError:
                back = f"; the run it was replacing is in '{shown(str(out_dir / ASIDE))}', which --resume puts back"
        lock.release()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        # which entry: a folder named config.yaml, a file named .replaced (a rename's target is its filename2)
        entry = getattr(e, "filename2", None) or getattr(e, "filename", None)
        if entry is not None and Path(os.fsdecode(entry)) != out_dir:
            reason = f"'{shown(os.fsdecode(entry))}': {reason}"
        raise UsageError(
            f"cannot write into out_dir '{shown(str(out_dir))}' ({reason}){back}; choose another out_dir") from None
    return lock, replaced


def move_aside(out_dir: Path) -> str | None:
    """Move the old run's files into out_dir/.replaced; a line naming them, or None when there were none."""
    files = _run_files(out_dir)
    if not files:
        return None
    aside, moving = out_dir / ASIDE, out_dir / MOVING_ASIDE
    shutil.rmtree(aside, ignore_errors=True)
    moving.mkdir()
    try:
        for path in files:
            os.replace(path, moving / path.name)
        os.replace(moving, aside)  # aside whole, or (killed before this) all of it found by recover_aside
    except OSError:  # a file named .replaced in the way, say: the old run stays as it was, and the error is said
        _move_back(moving, out_dir)
        raise
    events = sum(1 for p in files if p.name.startswith("events.out.tfevents."))
    names = [p.name for p in files if not p.name.startswith("events.")]
    names += [f"{events} TensorBoard file(s)"] * bool(events)
    return (f"overwrite: replacing the run in '{shown(str(out_dir))}' ({', '.join(names)}); it stays in {ASIDE}/ "
            f"until this run's first checkpoint, and comes back if this run ends before one")


def restore_aside(out_dir: Path) -> None:
    """Put the run that --overwrite moved aside back in place (this run ended before its first checkpoint)."""
    aside = out_dir / ASIDE
    if not aside.is_dir():
        return
    for path in _run_files(out_dir):  # what this run wrote in their place
        path.unlink()
    os.replace(aside, out_dir / MOVING_BACK)  # from here on, every run file in out_dir is the old run's
    _move_back(out_dir / MOVING_BACK, out_dir)


def _move_back(folder: Path, out_dir: Path) -> None:
    for path in folder.iterdir():
        os.replace(path, out_dir / path.name)
    folder.rmdir()


def drop_aside(out_dir: Path) -> None:
    """The new run has a checkpoint: the old run it replaced goes."""
    shutil.rmtree(out_dir / ASIDE, ignore_errors=True)


def recover_aside(out_dir: Path) -> None:
    """A run killed midway through an --overwrite left the old run aside: put it back if the new run saved nothing,
    else finish the job and delete it. Killed while the old run's files were on their way aside or back, it left them
    split between out_dir and a folder of their own, with nothing of the new run's: they go back together (the
    files in out_dir were once taken for the new run's and deleted, the old best.pt and TensorBoard logs among
    them)."""
    for folder in (MOVING_ASIDE, MOVING_BACK):
        if (out_dir / folder).is_dir():
            _move_back(out_dir / folder, out_dir)
    if (out_dir / ASIDE).is_dir():
        if (out_dir / "ckpt.pt").exists():
            drop_aside(out_dir)
        else:
            restore_aside(out_dir)
