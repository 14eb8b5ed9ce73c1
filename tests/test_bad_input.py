"""A table of bad inputs to train.py and sample.py (configs, overrides, data files, checkpoints, prompts, sampling
options): each is refused in one line with exit status 2, and out_dir is left as it was."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from test_train import one_error_line, snapshot
from training_runs import TINY, call, train_main, write_corpus

import sample
from model import load_checkpoint, model_from_checkpoint
from training.checkpoints import save_checkpoint


@dataclass
class Case:
    tmp: Path
    run: Path  # a copy of a finished run: --overwrite would replace it, so any early write would show
    corpus: Path

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        return path

    def train(self, *extra: str, config: str | Path = TINY, corpus: Path | None = None, **keys: object) -> list[str]:
        return ["--config", str(config), "--overwrite", *tiny_overrides(corpus or self.corpus, self.run, **keys),
                *extra]

    def yaml(self, text: str) -> list[str]:
        return self.train(config=self.file("run.yaml", text))

    def data(self, path: Path) -> list[str]:
        return self.train(corpus=path)

    def resume(self, change: Callable[[dict], None] | None = None, *extra: str, to: int = 30) -> list[str]:
        """A resume of the run (to step `to`: at its end, step 20, a resume is refused for that), its checkpoint
        changed first by change."""
        if change is not None:
            payload = load_checkpoint(self.run / "ckpt.pt")
            change(payload)
            save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")},
                            self.run / "ckpt.pt")
        return ["--resume", "--out-dir", str(self.run), f"train.max_iters={to}", *extra]

    def replace_checkpoint(self, write: Callable[[Path], object]) -> list[str]:
        write(self.run / "ckpt.pt")
        return ["--resume", "--out-dir", str(self.run)]

    def sample(self, *extra: str, checkpoint: Path | None = None) -> list[str]:
        where = ["--checkpoint", str(checkpoint)] if checkpoint else ["--out-dir", str(self.run)]
        return [*where, "--device", "cpu", "--max-new-tokens", "20", *extra]


LONG = "x" * 300  # one path component over the 255 bytes file systems allow
LINE_LIMIT = 400  # characters: an error line quotes short prefixes, never a whole value


def _changed_checkpoint(c: Case, **model_config: object) -> Path:
    """A copy of the run's checkpoint whose model_config says otherwise (vocabulary kept)."""
    payload = load_checkpoint(c.run / "best.pt")
    payload["model_config"] = {**payload["model_config"], **model_config}
    path = c.tmp / "changed.pt"
    save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")}, path)
    return path


def _resume_changed(c: Case, **model_config: object) -> list[str]:
    shutil.copyfile(_changed_checkpoint(c, **model_config), c.run / "ckpt.pt")
    return c.resume()


def _latin1(c: Case) -> Path:
    return c.file("latin1.txt", ("Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e. " * 40).encode("latin-1"))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shrink_vocab(payload: dict) -> None:
    payload["vocab"] = payload["vocab"][:-1]


def _weights_only(payload: dict) -> None:
    for key in ("optimizer", "config", "rng", "step", "best_val_loss", "scaler"):
        payload.pop(key)


def _optimizer_entry(payload: dict, key: str, value: object) -> None:
    """Set key of the first stepped weight's optimizer state that has it: torch loads the state without a look."""
    next(state for state in payload["optimizer"]["state"].values() if key in state)[key] = value


def _first_moment(payload: dict) -> torch.Tensor:
    return next(st for st in payload["optimizer"]["state"].values() if "exp_avg" in st)["exp_avg"]


def _nan_like_first_moment(payload: dict) -> torch.Tensor:
    return torch.full_like(_first_moment(payload), float("nan"))


def _nan_training_weights(payload: dict) -> None:
    payload["training_weights"] = {k: torch.full_like(v, float("nan")) for k, v in payload["model"].items()}


def _expanded_training_weights(payload: dict) -> None:
    # 10**12 values from one, in a file of a few MB: the finite check allocated 4 TB (a traceback)
    payload["training_weights"] = {k: v.clone() for k, v in payload["model"].items()}
    payload["training_weights"]["lm_head.weight"] = torch.zeros(1).expand(10**6, 10**6)


def _training_weights_as(payload: dict, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    payload["training_weights"] = {k: make(v) for k, v in payload["model"].items()}


def _only_best(c: Case) -> list[str]:
    (c.run / "ckpt.pt").unlink()  # train.py without --resume refuses the folder, which holds a run (best.pt)
    return ["--resume", "--out-dir", str(c.run)]


def _foreign(path: Path) -> None:
    torch.save({"state_dict": {"weight": torch.zeros(2, 2)}, "epoch": 3}, path)


def _nanogpt(path: Path) -> None:
    """What nanoGPT's train.py saves (out/ckpt.pt): a model and an optimizer state beside its model_args."""
    weights = {"transformer.wte.weight": torch.zeros(65, 8), "lm_head.weight": torch.zeros(65, 8)}
    torch.save({"model": weights, "optimizer": {}, "model_args": {"n_layer": 1, "n_embd": 8}, "iter_num": 250,
                "best_val_loss": torch.tensor(1.47), "config": {"dataset": "shakespeare_char"}}, path)


def _state_dict_only(path: Path) -> None:
    torch.save({"transformer.wte.weight": torch.zeros(65, 8), "lm_head.weight": torch.zeros(65, 8)}, path)


def _safetensors(path: Path) -> None:
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))


def _copy(path: Path, folder: Path, change: Callable[[Path], None]) -> Path:
    copy = Path(shutil.copy(path, folder / "copy.pt"))
    change(copy)
    return copy


def _unseen_vocab(c: Case) -> Path:
    """A copy of the run's checkpoint whose vocabulary and config agree with each other but not with the weights."""
    payload = load_checkpoint(c.run / "best.pt")
    payload["vocab"] = payload["vocab"][:-1]
    payload["model_config"] = {**payload["model_config"], "vocab_size": len(payload["vocab"])}
    path = c.tmp / "other_vocab.pt"
    save_checkpoint({k: v for k, v in payload.items() if k not in ("format", "version")}, path)
    return path


def _saved_config_crafted(c: Case, shape: str) -> list[str]:
    """A resume with --config of a checkpoint whose saved config is crafted: comparing it with the config given
    recursed without end (a mapping that holds itself), failed on a key that is no string (TypeError), or went on
    filling memory (a mapping of 2**40 paths in a few hundred bytes)."""
    def craft(payload: dict) -> None:
        junk: dict = {"leaf": 1}
        if shape == "itself":
            junk["x"] = junk
        else:
            for _ in range(40):
                junk = {"a": junk, "b": junk}
        payload["config"]["train"]["junk"] = junk
    return ["--config", str(TINY), *c.resume(craft)]


def _dangling_link(c: Case) -> list[str]:
    (c.tmp / "link").symlink_to(c.tmp / "nowhere")
    return c.train(f"out_dir={c.tmp / 'link'}")


def _folder(c: Case, name: str = "a_folder") -> Path:
    (c.tmp / name).mkdir()
    return c.tmp / name


TEMPERATURE_ZERO = "temperature-0-is-greedy"  # the documented exception: not refused, it means greedy decoding

BAD_INPUTS: list[tuple[str, str, Callable[[Case], list[str]], str]] = [
    # id, program, arguments, a fragment of the one-line error
    # --- config files
    ("yaml-a-list", "train", lambda c: c.yaml("- data\n- model\n"), "must hold a mapping of sections"),
    ("yaml-a-number", "train", lambda c: c.yaml("42\n"), "must hold a mapping of sections"),
    ("yaml-python-tag", "train", lambda c: c.yaml(f"seed: !!python/object/apply:os.system ['touch {c.tmp}/pwned']\n"),
     "is not valid YAML"),
    ("yaml-python-object", "train", lambda c: c.yaml("train: !!python/object:collections.OrderedDict {}\n"),
     "could not determine a constructor for the tag"),
    ("yaml-syntax", "train", lambda c: c.yaml("model: [1, 2\n"), "is not valid YAML"),
    ("yaml-impossible-date", "train", lambda c: c.yaml("seed: 2024-13-45\n"), "month must be in 1..12"),
    ("yaml-unknown-section", "train", lambda c: c.yaml("optimiser:\n  lr: 0.1\n"), "unknown config key 'optimiser'"),
    ("yaml-unknown-key", "train", lambda c: c.yaml("train:\n  lr: 0.1\n"), "unknown config key 'train.lr'"),
    ("yaml-section-not-a-mapping", "train", lambda c: c.yaml("train: 5\n"), "section 'train'"),
    ("yaml-wrong-type", "train", lambda c: c.yaml("model:\n  n_layer: two\n"), "model.n_layer must be an integer"),
    ("config-missing", "train", lambda c: c.train(config=c.tmp / "nope.yaml"), "config file: no such file"),
    ("config-a-folder", "train", lambda c: c.train(config=_folder(c)), "is a folder, not a file"),
    ("config-binary", "train", lambda c: c.train(config=c.file("bin.yaml", b"\xff\xfe\x00\x01")),
     "cannot read config file"),
    # --- command-line overrides
    ("override-without-value", "train", lambda c: c.train("train.max_iters"), "must look like KEY=VALUE"),
    ("override-unknown-key", "train", lambda c: c.train("model.n_embed=32"), "did you mean 'model.n_embd'"),
    # a YAML escape ("\\x00", "\\ud800") puts either in a name: a ValueError or UnicodeEncodeError traceback at the lock
    ("out-dir-with-a-nul", "train", lambda c: c.train(f"out_dir={c.tmp}/a\0b"),
     "/a\\x00b' is not a usable path (it holds a NUL character); choose another (command line: "),
    ("out-dir-with-a-lone-surrogate", "train", lambda c: c.train(f"out_dir={c.tmp}/\ud800"),
     "/\\ud800' holds a lone surrogate (half of a UTF-16 pair); choose another (command line: "),
    ("out-dir-a-link-to-nowhere", "train", _dangling_link,  # was "cannot write into out_dir 'link' (File exists)"
     "is a symbolic link that leads nowhere (to '"),
    # "unrecognized arguments: --max_iters", and no more
    ("setting-as-option", "train", lambda c: c.train("--max_iters", "3"),
     "settings are KEY=VALUE words, not options: train.max_iters=3 (see train.py --help)"),
    ("setting-as-dotted-option", "train", lambda c: c.train("--train.lr=0.1"),
     "not options: train.learning_rate=0.1 "),
    # the rate warmed up to its peak until step 100, then dropped straight to min_lr, without a word
    ("decay-ends-before-warmup", "train", lambda c: c.train("train.warmup_iters=100", "train.lr_decay_iters=10"),
     "train.lr_decay_iters (10) must be above train.warmup_iters (100), or the rate drops from its warmup straight "
     "to min_lr"),
    ("override-no-key", "train", lambda c: c.train("=5"), "override '=5' must look like KEY=VALUE"),  # key ''
    ("override-a-section", "train", lambda c: c.train("train=1"),  # was "did you mean 'train.dtype'?"
     "'train' is a section of the config, not a key; give train.KEY=VALUE (such as train.batch_size=...;"),
    ("override-huge-integer", "train", lambda c: c.train("train.max_iters=1e100"),  # all 101 digits, before
     "train.max_iters must be at most 2**63 - 1, got 1.000e+100 (command line: train.max_iters=1e100)"),
    ("override-wrong-type", "train", lambda c: c.train(**{"train.compile": "maybe"}),
     "must be one of auto, true, false"),
    ("override-negative-rate", "train", lambda c: c.train(**{"train.learning_rate": -0.1}), "finite number >= 0"),
    ("override-dropout-1", "train", lambda c: c.train(**{"model.dropout": 1.0}), "model.dropout must be in [0, 1)"),
    ("override-ema-decay-1", "train", lambda c: c.train(**{"train.ema_decay": 1.0}),
     "train.ema_decay must be in [0, 1)"),
    ("override-unknown-optimizer", "train", lambda c: c.train(**{"train.optimizer": "sgd"}),
     "train.optimizer must be one of adamw, muon; got 'sgd'"),
    ("override-seed-too-big", "train", lambda c: c.train(seed=2**64), "seed must fit"),
    ("override-threads-absurd", "train", lambda c: c.train(**{"train.threads": 10**6}), "must be at most 4096"),
    ("override-learning-rate-past-float32-for-muon", "train",  # a RuntimeError from torch at step 1
     lambda c: c.train(**{"train.learning_rate": 1e39, "train.optimizer": "muon"}), "is too large for Muon"),
    ("n_embd-not-divisible-by-n_head", "train", lambda c: c.train(**{"model.n_embd": 30, "model.n_head": 4}),
     "must be divisible by model.n_head, got 30 and 4"),
    ("flags-contradict", "train", lambda c: c.train("--resume"), "contradict"),
    ("out-dir-flag-and-key-contradict", "train", lambda c: c.train("--out-dir", str(c.tmp / "other")),
     "and out_dir='"),
    ("data-path-and-dataset-both-given", "train", lambda c: c.train("data.dataset=shakespeare_char"),
     "data.path and data.dataset are both given on the command line"),
    ("out_dir-under-a-file", "train",
     lambda c: c.train(f"out_dir={c.file('plain.txt', 'x')}/run"), "cannot write into out_dir"),
    # --- data files
    ("data-empty", "train", lambda c: c.data(c.file("empty.txt", "")), "is empty"),
    ("data-one-character", "train", lambda c: c.data(c.file("one.txt", "a")), "has 1 character, but"),
    ("data-shorter-than-a-window", "train", lambda c: c.data(c.file("short.txt", "abcdefg")), "block_size + 1 = 9"),
    ("data-binary", "train", lambda c: c.data(c.file("noise.bin", bytes(range(256)) * 8)), "is a binary file"),
    ("data-latin-1", "train", lambda c: c.data(_latin1(c)), "is not UTF-8"),
    ("data-a-folder", "train", lambda c: c.data(_folder(c)), "is a folder"),
    ("data-missing", "train", lambda c: c.data(c.tmp / "corpus.tx"), "did you mean"),
    ("data-a-checkpoint", "train", lambda c: c.data(c.run / "best.pt"), "is a binary file"),
    ("data-nul-in-path", "train", lambda c: ["--overwrite", "--config", str(c.file("nul.yaml", f'out_dir: {c.run}\n'
     'data:\n  path: "a\\0b"\n'))], "not a usable path"),
    # --- checkpoints, resumed
    ("resume-truncated", "train", lambda c: c.replace_checkpoint(_truncate), "truncated or not a checkpoint"),
    ("resume-another-program", "train", lambda c: c.replace_checkpoint(_foreign), "not a tinychar checkpoint"),
    ("resume-vocab-not-the-weights", "train", lambda c: c.resume(_shrink_vocab), "is inconsistent"),
    ("resume-weights-only", "train", lambda c: c.resume(_weights_only), "holds weights only"),
    ("resume-lost-rng", "train", lambda c: c.resume(lambda p: p.pop("rng")), "lacks rng"),
    # a ZeroDivisionError after restore_best had copied the checkpoint over best.pt; an AttributeError; a divergence
    ("resume-negative-step", "train", lambda c: c.resume(lambda p: p.update(step=-5)), "has a damaged step (-5"),
    ("resume-optimizer-not-a-mapping", "train", lambda c: c.resume(lambda p: p.update(optimizer="x")),
     "has a damaged optimizer state"),
    ("resume-optimizer-state-not-a-mapping", "train", lambda c: c.resume(lambda p: p["optimizer"].update(state="x")),
     "has a damaged optimizer state (not a mapping)"),
    ("resume-nan-training-weights", "train", lambda c: c.resume(_nan_training_weights), "has damaged training weights"),
    # the resume went on from the average: silently another run (val 3.4456 against 3.3467 at step 30)
    ("resume-without-training-weights", "train", lambda c: c.resume(lambda p: p.pop("training_weights")),
     "holds the weights' average (train.ema_decay) without the weights it was taken of (training_weights); it is "
     "damaged and cannot be resumed"),
    ("resume-training-weights-of-another-shape", "train", lambda c: c.resume(_expanded_training_weights),
     "has damaged training weights (the weights its average was taken of: not the model's shapes"),
    # trained on as numbers (val 5.59 against 3.37 at step 30 from booleans; complex ones with torch's warning on
    # stderr), or a traceback from the finite check (meta): the average's own weights were refused so already
    ("resume-training-weights-booleans", "train",
     lambda c: c.resume(lambda p: _training_weights_as(p, lambda v: v > 0)),
     "has damaged training weights (the weights its average was taken of: booleans in 'transformer."),
    ("resume-training-weights-complex", "train",
     lambda c: c.resume(lambda p: _training_weights_as(p, lambda v: v.to(torch.complex64))), "complex numbers in '"),
    ("resume-training-weights-on-the-meta-device", "train",
     lambda c: c.resume(lambda p: _training_weights_as(p, lambda v: torch.empty(v.shape, device="meta"))),
     "a tensor with no values (on the meta device) in '"),
    # the optimizer's state, which torch loads unchecked: a crash of the process in the fused AdamW kernel (a
    # segmentation fault, after config.yaml and best.pt were rewritten), tracebacks, or NaNs blamed on the learning rate
    ("resume-optimizer-moment-of-another-shape", "train",
     lambda c: c.resume(lambda p: _optimizer_entry(p, "exp_avg", torch.zeros(3, 3))), "has a damaged training state"),
    ("resume-optimizer-step-not-a-tensor", "train", lambda c: c.resume(lambda p: _optimizer_entry(p, "step", 5)),
     "the optimizer's step of the weight of shape"),
    ("resume-optimizer-momentum-of-another-shape", "train",
     lambda c: c.resume(lambda p: _optimizer_entry(p, "momentum_buffer", torch.zeros(2, 2))), "momentum_buffer"),
    # torch casts the moments to their weight's type as it loads them: complex ones lost their imaginary part (with
    # its warning on stderr), booleans were taken as 1.0 and 0.0, and the run went on
    ("resume-optimizer-complex-moment", "train",
     lambda c: c.resume(lambda p: _optimizer_entry(p, "exp_avg", _first_moment(p).to(torch.complex64))),
     "has a damaged optimizer state (complex numbers in its exp_avg); it cannot be resumed"),
    ("resume-optimizer-boolean-moment", "train",
     lambda c: c.resume(lambda p: _optimizer_entry(p, "exp_avg_sq", _first_moment(p) > 0)),
     "has a damaged optimizer state (booleans in its exp_avg_sq)"),
    ("resume-optimizer-nan-moment", "train",
     lambda c: c.resume(lambda p: _optimizer_entry(p, "exp_avg_sq", _nan_like_first_moment(p))),
     "is not all finite numbers"),
    # every moment afresh at step 20: a run that went on, not as it would have
    ("resume-optimizer-state-empty", "train", lambda c: c.resume(lambda p: p["optimizer"].update(state={})),
     "its optimizer state is empty at step 20"),
    ("resume-nan-best-loss", "train", lambda c: c.resume(lambda p: p.update(best_val_loss=float("nan"))),
     "its best validation loss is nan"),
    ("resume-vocabulary-out-of-order", "train",  # a ValueError traceback from the tokenizer
     lambda c: c.resume(lambda p: p.update(vocab=[p["vocab"][1], p["vocab"][0], *p["vocab"][2:]])), "out of order"),
    # a RuntimeError traceback from bool() of the tensor; "trained on two texts", of the same text
    ("resume-eval-pending-a-tensor", "train", lambda c: c.resume(lambda p: p.update(eval_pending=torch.zeros(3))),
     "has a damaged eval_pending (Tensor, where a run saves bool); it cannot be resumed"),
    ("resume-fingerprint-a-tensor", "train", lambda c: c.resume(lambda p: p.update(data_fingerprint=torch.zeros(3))),
     "has a damaged data_fingerprint (Tensor, where a run saves str)"),
    ("resume-saved-by-half-processes", "train", lambda c: c.resume(lambda p: p.update(world_size=2.5)),
     "has a damaged world_size (float, where a run saves int)"),
    ("resume-saved-by-no-processes", "train", lambda c: c.resume(lambda p: p.update(world_size=0)),
     "saved by 0 processes"),
    # the run config builds the resumed model, the model config the saved one: n_head edited in one alone resumed
    # another model (its weights are the same shapes) without a word
    ("resume-run-config-not-the-models", "train", lambda c: c.resume(lambda p: p["config"]["model"].update(n_head=1)),
     "has a run config that says model.n_head=1 where its model was built with "),
    # a value that is no plain value is the run config's own check's: the comparison was a traceback
    ("resume-run-config-holds-a-tensor", "train",
     lambda c: c.resume(lambda p: p["config"]["model"].update(n_layer=torch.tensor([3, 3]))),
     "model.n_layer must be an integer, got tensor([3, 3])"),
    ("resume-unknown-key-saved", "train", lambda c: c.resume(lambda p: p["config"]["train"].update(foo=1)),
     "unknown config key 'train.foo' (in the config saved in '"),
    ("resume-with-config-saved-config-holds-itself", "train", lambda c: _saved_config_crafted(c, "itself"),
     "unknown config key 'train.junk' (in the config saved in '"),
    ("resume-with-config-saved-config-of-2-40-paths", "train", lambda c: _saved_config_crafted(c, "paths"),
     "unknown config key 'train.junk' (in the config saved in '"),
    ("resume-below-the-step", "train", lambda c: c.resume(None, "train.max_iters=1"),
     "train.max_iters=1 is below step "),
    # it evaluated and saved the last step again, and logged its points to TensorBoard twice
    ("resume-at-the-end", "train", lambda c: c.resume(None, to=20), "train.max_iters=20 is step 20, where '"),
    ("resume-only-best-pt", "train", lambda c: _only_best(c), "only best.pt, the run's best step; to continue from "
     "that step, copy it: cp "),
    ("resume-changed-data", "train", lambda c: c.resume(None, "data.val_fraction=0.2"), "data.val_fraction"),
    ("resume-changed-model", "train", lambda c: c.resume(None, "model.dropout=0.3"), "model.dropout"),
    # --- prompts and sampling options
    ("prompt-unseen-characters", "sample", lambda c: c.sample("--prompt", "Zebra \u20ac"), "never saw"),
    # a lone mark sat on the quote before it ('́'), a joiner was '\u200d'
    ("prompt-unseen-marks", "sample", lambda c: c.sample("--prompt", "a\u0301\u200d"),
     "never saw in training: U+0301, U+200D; remove or replace them"),
    # a prompt file saved on Windows: said as '\r' alone, which did not say why the file held one
    ("prompt-windows-line-ends", "sample", lambda c: c.sample("--prompt", "All:\r\nHi"), "remove or replace them "
     "(its lines end in \\r\\n, as Windows saves text: save it with \\n line endings, e.g. dos2unix)"),
    ("prompt-empty", "sample", lambda c: c.sample("--prompt", ""), "prompt is empty"),
    ("prompt-file-latin-1", "sample", lambda c: c.sample("--prompt-file", str(_latin1(c))), "is not UTF-8"),
    ("max-new-tokens-negative", "sample", lambda c: c.sample("--max-new-tokens", "-1"), "must be >= 0"),
    ("max-new-tokens-absurd", "sample", lambda c: c.sample("--max-new-tokens", str(10**15)), "at most"),
    (TEMPERATURE_ZERO, "sample", lambda c: c.sample("--prompt", "All:", "--temperature", "0"), ""),
    ("top-k-zero", "sample", lambda c: c.sample("--top-k", "0"), "--top-k must be >= 1"),
    ("top-p-above-one", "sample", lambda c: c.sample("--top-p", "1.5"), "--top-p must be in (0, 1]"),
    ("seed-too-big", "sample", lambda c: c.sample("--seed", str(2**64)), "--seed must fit"),
    # --- checkpoints, sampled
    ("checkpoint-truncated", "sample", lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _truncate)),
     "truncated or not a checkpoint"),
    ("checkpoint-another-program", "sample", lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _foreign)),
     "not a tinychar checkpoint; tinychar reads the checkpoints its own train.py writes"),
    # each said only "is not a tinychar checkpoint"; safetensors' that its package was not installed
    ("checkpoint-of-nanogpt", "sample", lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _nanogpt)),
     "is not a tinychar checkpoint: it looks like nanoGPT's (model_args, iter_num), whose model and vocabulary "
     "tinychar cannot rebuild; tinychar reads"),
    ("checkpoint-weights-only", "sample",
     lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _state_dict_only)),
     "is not a tinychar checkpoint: it holds weights only (2 tensors), without the model config and vocabulary"),
    ("checkpoint-safetensors", "sample", lambda c: c.sample(checkpoint=_copy(c.run / "best.pt", c.tmp, _safetensors)),
     "is a safetensors file; tinychar reads the .pt checkpoints its own train.py writes"),
    ("checkpoint-vocab-not-the-weights", "sample", lambda c: c.sample(checkpoint=_unseen_vocab(c)),
     "weights do not match"),
    ("checkpoint-is-text", "sample", lambda c: c.sample(checkpoint=c.corpus), "not a file that torch.save wrote"),
    ("checkpoint-a-folder", "sample", lambda c: c.sample(checkpoint=_folder(c)), "is a folder, not a checkpoint file"),
    # --- a newline in a path a message names (one_error_line: still one line)
    ("checkpoint-missing-newline-in-path", "sample", lambda c: c.sample(checkpoint=c.tmp / "no\nsuch.pt"),
     "no checkpoint at '"),
    ("out-dir-without-a-run-newline-in-path", "sample", lambda c: ["--out-dir", str(_folder(c, "x\ny"))],
     "x\\ny' holds no best.pt or ckpt.pt"),
    ("resume-without-a-run-newline-in-path", "train", lambda c: ["--resume", "--out-dir", str(_folder(c, "x\ny"))],
     "nothing to resume: no '"),
    # --- an empty --config (`--config "$CFG"`, CFG unset) trained on configs/tiny.yaml
    ("config-empty", "train", lambda c: ["--config", "", f"out_dir={c.run}"], "--config is empty; give a config file"),
    # --- every OSError on a user's path is one line
    ("data-newline-in-path", "train", lambda c: c.data(c.tmp / "two\nlines.txt"), "no such file"),
    ("out_dir-name-too-long", "train", lambda c: c.train(f"out_dir={c.tmp / LONG}"), "File name too long"),
    ("config-name-too-long", "train", lambda c: c.train(config=c.tmp / f"{LONG}.yaml"), "File name too long"),
    ("data-name-too-long", "train", lambda c: c.data(c.tmp / LONG), "File name too long"),
    ("cache-dir-name-too-long", "train", lambda c: c.train(**{"data.cache_dir": c.tmp / LONG}), "File name too long"),
    ("checkpoint-name-too-long", "sample", lambda c: c.sample(checkpoint=c.tmp / f"{LONG}.pt"), "File name too long"),
    ("sample-out-dir-name-too-long", "sample", lambda c: ["--out-dir", str(c.tmp / LONG)], "File name too long"),
    # --- nothing wrong in silence; blame where it is due
    ("yaml-duplicate-section", "train", lambda c: c.yaml("train:\n  max_iters: 5\ntrain:\n  batch_size: 4\n"),
     "sets 'train' twice (lines 1 and 3)"),
    ("override-blamed-on-the-command-line", "train", lambda c: c.train(**{"model.n_layer": 0}), "command line"),
    ("checkpoint-fractional-layers", "sample", lambda c: c.sample(checkpoint=_changed_checkpoint(c, n_layer=2.5)),
     "model.n_layer must be an integer, got 2.5"),
    ("resume-fractional-layers", "train", lambda c: _resume_changed(c, n_layer=2.5),
     "model.n_layer must be an integer, got 2.5"),
]


def test_the_bad_input_table_covers_what_it_promises():
    assert len(BAD_INPUTS) >= 30
    assert len({case[0] for case in BAD_INPUTS}) == len(BAD_INPUTS)
    assert {program for _, program, _, _ in BAD_INPUTS} == {"train", "sample"}


@pytest.mark.parametrize(("program", "make", "fragment"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_out_dir_is_left_as_it_was(
    straight, tmp_path, capsys, request, program, make, fragment
):
    run = Path(shutil.copytree(straight[0], tmp_path / "run"))
    case = Case(tmp=tmp_path, run=run, corpus=write_corpus(tmp_path))
    args = make(case)
    before = snapshot(run)
    code, out, err = call(train_main if program == "train" else sample.main, args, capsys)
    assert snapshot(run) == before  # not a byte written, not a file touched
    assert not (tmp_path / "pwned").exists()
    if request.node.callspec.id == TEMPERATURE_ZERO:
        assert code == 0, err
        assert out == greedy(run / "best.pt", "All:", 20) + "\n"
        return
    assert code == 2, err
    line = one_error_line(err)
    # The run's folder counts as one word: a line may name it whole (the cp command that mends a run missing its
    # ckpt.pt names it twice), and pytest's temp folder is longer on some machines (macOS's /var/folders/...), where
    # that line passed LINE_LIMIT with the product unchanged
    assert fragment in line and len(line.replace(str(run), "RUN")) < LINE_LIMIT, line
    if program == "sample":
        assert out == ""


@pytest.mark.parametrize(("main", "args", "fragment"), [
    (train_main, ["--" + "x" * 5000], "unrecognized arguments: --xxx"),
    (sample.main, ["--compile", "y" * 5000], "invalid choice: 'yyy"),
])
def test_a_huge_argument_argparse_refuses_is_quoted_in_a_short_line(capsys, main, args, fragment):
    code, out, err = call(main, args, capsys)
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert fragment in line and len(line) < 500  # argparse alone quoted all 5,000 characters
    assert line.endswith("--help)")


def test_an_attention_map_that_cannot_be_written_is_one_error_line_whatever_its_path(straight, tmp_path, capsys,
                                                                                     monkeypatch):
    """Refused before the model loads, or, where the path changed after that check, found after it (the model's line
    on stderr comes first): one error line all the same, exit status 2."""
    blocker = tmp_path / "a\nfile"
    blocker.write_text("a file where the picture's folder would be", encoding="utf-8")
    args = ["--out-dir", str(straight[0]), "--attention-map", str(blocker / "map.png"), "--max-new-tokens", "5"]
    code, out, err = call(sample.main, args, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --attention-map '") and "a\\nfile/map.png': '" in err and "is a file" in err

    import lab.pictures

    monkeypatch.setattr(lab.pictures, "check_picture_path", lambda path: Path(path))  # as if made after the check
    code, out, err = call(sample.main, args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert " parameters, step 20" in lines[0]  # the model's line, on one line too
    assert lines[1].startswith("error: cannot write --attention-map '") and "a\\nfile/map.png': " in lines[1]


def greedy(path: Path, prompt: str, n: int) -> str:
    """The prompt and the n likeliest next characters, one at a time, computed here from the checkpoint."""
    model, vocab = model_from_checkpoint(load_checkpoint(path))
    model.eval()
    idx = torch.tensor([[vocab.index(c) for c in prompt]])
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -model.config.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return "".join(vocab[i] for i in idx[0].tolist())
