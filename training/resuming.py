"""Which checkpoint a --resume continues, found before torch is imported: train.py says at once that a run folder has
nothing to resume (a typo, a run that never saved), and load_run (training/checkpoints.py) finds it again and reads
it; and which of its settings a resume may change."""

from __future__ import annotations

from pathlib import Path

from configs import apply_overrides, flatten, to_dict
from configs.errors import UsageError
from configs.userinput import path_word, shown
from model.runs import ASIDE_FOLDERS

from .config import RunConfig, copied_run, load_config
from .launch import LaunchError, launch_from_env
from .lock import RunLock, in_use

# Keys a resumed run may change: they steer how long and how visibly it runs, not what it learns so far.
RESUMABLE_CHANGES = frozenset({
    "out_dir", "train.max_iters", "train.lr_decay_iters", "train.min_lr", "train.eval_interval",
    "train.eval_iters", "train.log_interval", "train.device", "train.dtype", "train.compile",
    "train.threads", "train.sample_chars", "train.tensorboard", "train.backend", "data.cache_dir",
})


def resume_target(config: str | None, overrides: list[str]) -> tuple[RunConfig | None, Path, Path, bool]:
    """(the run's config when one is named, else None: the run goes on with its saved one; its out_dir; the ckpt.pt
    to continue; whether that is the one an interrupted --overwrite left aside). UsageError, saying what will do,
    when there is none, or when a live run holds the folder."""
    cfg = None
    located = [o for o in overrides if o.partition("=")[0].strip() == "out_dir"]
    if config is not None:
        cfg = load_config(config, overrides, resuming=True)
        out_dir = Path(cfg.out_dir)
        if not located and (why := copied_run(Path(config), out_dir)):
            raise UsageError(why)
    else:
        # The run goes on with its saved config; the overrides' keys and types are checked first, the rest once read.
        apply_overrides({}, overrides, RunConfig)
        out_dir = Path(load_config(None, located, base={}).out_dir if located else load_config(None, []).out_dir)
    ckpt = out_dir / "ckpt.pt"
    if holder := RunLock(out_dir).busy():  # a live run is still writing it
        raise in_use(out_dir, holder)
    aside = next((p for p in (out_dir / f / "ckpt.pt" for f in ASIDE_FOLDERS) if p.exists()), None)
    # an --overwrite killed before its first checkpoint left the old run aside: claim_out_dir puts it back first
    if recovered := not ckpt.exists() and aside is not None:
        ckpt = aside
    if not ckpt.exists():  # a train.py without --resume would refuse the folder for holding a run: say what will do
        if (kept := next((f for f in ("", *ASIDE_FOLDERS) if (out_dir / f / "best.pt").is_file()), None)) is not None:
            way = f"copy it: cp {path_word(str(out_dir / 'best.pt'))} {path_word(str(ckpt))}"
            if kept:  # put back first: finding a ckpt.pt, the claim would delete the folder, curves and all
                way = (f"put back the run that an interrupted --overwrite left in {kept}/, and copy it: cd "
                       f"{path_word(str(out_dir))} && mv {kept}/* . && rmdir {kept} && cp best.pt ckpt.pt")
            raise UsageError(f"nothing to resume: no '{shown(str(ckpt))}', only best.pt, the run's best step; to "
                             f"continue from that step, {way}")
        raise UsageError(f"nothing to resume: no '{shown(str(ckpt))}'; " + (
            "every process of a run reads its out_dir's ckpt.pt, and rank 0 alone writes one: copy rank 0's to this "
            "machine's out_dir, or give the processes one shared out_dir" if _a_later_rank() else
            "start the run without --resume"))
    if ckpt.is_dir():  # not the file a run writes
        kind = "a link to a folder" if ckpt.is_symlink() else "a folder"
        raise UsageError(f"'{shown(str(ckpt))}' is {kind}, where a run keeps the checkpoint --resume continues from; "
                         "move it out of out_dir, then --resume again")
    return cfg, out_dir, ckpt, recovered


def _a_later_rank() -> bool:
    """Whether this process is one of a torchrun launch's other than rank 0 (whose out_dir, on another machine, may
    hold no copy of the checkpoint rank 0 saved)."""
    try:
        launch = launch_from_env()
    except LaunchError:  # said elsewhere
        return False
    return launch.torchrun and not launch.main


def config_changes(saved: dict, later: dict, fingerprinted: bool) -> tuple[dict, dict, list[str], list[str]]:
    """Two run configs (as saved: nested dicts) flattened, the keys that differ, and those of them a resume refuses
    (check_resume_config)."""
    old, new = flatten(saved), flatten(later)
    for flat in (old, new):
        if flat.get("data.path") is not None and flat.get("data.dataset") is not None:
            flat["data.dataset"] = None  # a run saved with both (as runs once were) read its data.path (see one_text)
    # A key a saved config lacks was added since (model.type): the saved run had its default.
    defaults = flatten(to_dict(RunConfig()))
    for flat, other in ((old, new), (new, old)):
        flat.update({k: defaults[k] for k in set(other) - set(flat) if k in defaults and k != "out_dir"})
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    refused = [k for k in changed if k not in RESUMABLE_CHANGES and not (fingerprinted and k == "data.path"
                                                                          and new.get(k) is not None)]
    return old, new, changed, refused


def check_resume_config(saved: dict, cfg: RunConfig, fingerprinted: bool = False) -> list[str]:
    """Keys whose change a resume accepts are returned as 'key: old -> new'; any other change is refused.

    fingerprinted: the checkpoint records its text's fingerprint, which the resume compares with the text it reads
    (runner.check_same_text): then data.path may change too, since the text may not. A run started on a relative
    data.path and resumed from another folder needs that, to name the same file by a path that works from there."""
    old, new, changed, refused = config_changes(saved, to_dict(cfg), fingerprinted)
    if refused == ["data.dataset"] and new.get("data.path") is not None:  # a data.path given, not a dataset changed
        raise UsageError(f"cannot resume on data.path={new['data.path']!r}: this run was trained on data.dataset="
                         f"{old['data.dataset']}; start a new run in another out_dir for another text")
    if refused:
        shown = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in refused[:4])
        raise UsageError(f"cannot resume with a changed {shown}: these define the model, data or optimisation of "
                         f"the saved run; start a new run in another out_dir instead")
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed if k != "out_dir"]
