"""Tests for training/memory.py: the estimate follows the model, and a run that cannot fit is refused in one line
before anything is allocated."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, tiny_overrides
from training_runs import write_corpus

import train
import training.memory
from model import GPT, GPTConfig
from training.config import load_config
from training.errors import UsageError
from training.memory import MemoryNeed, activation_bytes, check_fits, model_need, parameter_count, training_need

TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("kw", [
    {}, {"bias": False}, {"score": "additive"}, {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 3},
    {"attention": "fused", "block_size": 64, "n_embd": 128}, {"norm": "post"}, {"norm": "post", "bias": False},
])
def test_the_parameter_count_is_the_model_s(kw) -> None:
    cfg = GPTConfig(vocab_size=65, **kw)
    assert parameter_count(cfg) == GPT(cfg).num_params(non_embedding=False)


@pytest.mark.parametrize("kind", ["gru", "bigram", "lstm"])
@pytest.mark.parametrize("n_layer", [1, 2, 3, 5, 8])
def test_the_parameter_count_of_the_other_models_is_theirs(kind, n_layer) -> None:
    from model import build_model

    cfg = GPTConfig(vocab_size=65, type=kind, n_layer=n_layer, n_embd=16, n_head=2)
    assert parameter_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_a_gru_of_a_hundred_million_layers_is_counted_without_building_them() -> None:
    # built layer by layer on the meta device, this took minutes (train.py model.type=gru model.n_layer=100000000
    # hung before its memory check could refuse it)
    deep = GPTConfig(vocab_size=65, type="gru", n_layer=10**8, n_embd=16, n_head=2)
    two, three = (parameter_count(replace(deep, n_layer=n)) for n in (2, 3))
    assert parameter_count(deep) == three + (10**8 - 3) * (three - two)


def test_the_estimate_grows_with_what_it_should() -> None:
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    base = training_need(cfg, 12, 512)
    assert base.total < 1e9  # nanoGPT's CPU config is far from a gigabyte
    assert training_need(cfg, 24, 12).activations > training_need(cfg, 12, 12).activations  # batch
    assert training_need(cfg, 12, 1024).activations > base.activations  # the evaluation pass, when it is larger
    assert training_need(replace(cfg, block_size=128), 12, 512).masks == 4 * base.masks  # masks are T x T
    assert training_need(replace(cfg, n_layer=8), 12, 512).weights > base.weights
    # the weights' moving average and, while it is evaluated, a copy of the weights: two more sets of parameters
    assert training_need(cfg, 12, 512, averaged=True).weights == base.weights * 6 // 4
    additive = activation_bytes(replace(cfg, score="additive"), 12, backward=True)
    assert additive > activation_bytes(cfg, 12, backward=True)


@pytest.mark.parametrize(("attention", "dropout"), [("fused", 0.0), ("fused", 0.2), ("manual", 0.0), ("manual", 0.2)])
def test_the_estimate_is_above_what_the_forward_keeps_for_backward(attention, dropout) -> None:
    """Off CUDA the fused kernel with dropout is PyTorch's math path, which keeps every head's scores: counted as the
    fused kernel's none, shakespeare_char.yaml's batch 44 passed the check under a 4 GB limit and ran out of memory in
    its first step."""
    cfg = GPTConfig(vocab_size=65, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=dropout, attention=attention)
    torch.manual_seed(0)
    model, x = GPT(cfg).train(), torch.randint(0, 65, (2, 256))
    kept = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(x, x)
    assert activation_bytes(cfg, 2, backward=True) > sum(kept.values())
    if attention == "fused":  # CUDA's fused kernels take the dropout themselves, and keep no scores
        cuda = activation_bytes(cfg, 2, backward=True, device=torch.device("cuda"))
        assert cuda == activation_bytes(replace(cfg, dropout=0.0), 2, backward=True)


@pytest.mark.parametrize("kw", [{}, {"n_layer": 4, "block_size": 64, "n_embd": 128}])
def test_the_masks_estimate_is_what_the_models_layers_keep(kw) -> None:
    cfg = GPTConfig(vocab_size=65, **kw)
    kept = sum(buffer.nbytes for name, buffer in GPT(cfg).named_buffers() if name.endswith(".mask"))
    assert kept == training_need(cfg, 12, 512).masks == model_need(cfg).masks > 0


def test_a_need_beyond_what_is_free_is_refused_with_the_numbers_and_what_to_change(monkeypatch) -> None:
    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 23 * 10**9)
    cpu = torch.device("cpu")
    check_fits(MemoryNeed(weights=10**9, masks=0, activations=10**9), cpu)  # fits: nothing said
    with pytest.raises(UsageError) as info:
        check_fits(MemoryNeed(weights=10**9, masks=0, activations=36 * 10**9), cpu)
    assert str(info.value) == ("this run needs about 37.0 GB of memory and this machine has 23.0 GB free; use a "
                               "smaller train.batch_size (train.grad_accum_steps keeps the batch per step), "
                               "model.block_size or model.n_layer")
    with pytest.raises(UsageError, match=r"needs about 2 processes x 12.0 GB .* smaller model.block_size"):
        check_fits(MemoryNeed(weights=10**9, masks=11 * 10**9, activations=0), cpu, processes=2)


def test_a_need_just_past_what_is_free_reads_as_more(monkeypatch) -> None:
    # "needs about 1.9 GB of memory and this machine has 1.9 GB free"
    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 1_880_000_000)
    with pytest.raises(UsageError, match=r"needs about 1,920 MB of memory and this machine has 1,880 MB free; "):
        check_fits(MemoryNeed(weights=10**9, masks=0, activations=920_000_000), torch.device("cpu"))
    monkeypatch.setattr(training.memory, "process_limit_available", lambda: 1_880_000_000)
    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 23 * 10**9)
    with pytest.raises(UsageError, match=r"needs about 1,920 MB of memory and .* 1,880 MB; raise the limit .* \(the "
                                         r"machine has 23.0 GB free\)"):
        check_fits(MemoryNeed(weights=10**9, masks=0, activations=920_000_000), torch.device("cpu"))


def test_the_text_of_a_sampling_request_is_counted_on_the_device_and_in_the_cpus_memory() -> None:
    from training.memory import text_bytes

    # 3 samples of 100 characters after a prompt of 7: the plain paths' int64 context of 3 x 107 ids on the device,
    # and the 3 x 100 ids sample.py keeps until it writes them (4 bytes each, and room to grow)
    assert text_bytes(3, 7, 100) == (3 * 107 * 8, 3 * 100 * 5)
    cfg = GPTConfig(vocab_size=65)
    need = model_need(cfg, 3, text=10**12)
    assert need.total == model_need(cfg, 3).total + 10**12 and need.dominant() == "text"
    assert need.largest() == "fewer --num-samples or a smaller --max-new-tokens"
    assert model_need(cfg, 3).dominant() != "text"


def test_free_memory_is_known_here() -> None:
    free = training.memory.available_bytes(torch.device("cpu"))
    assert free is not None and free > 10**8


@pytest.mark.parametrize(("override", "part"), [
    ("train.batch_size=1000000000", "train.batch_size"),
    ("model.block_size=100000", "model.block_size"),
    ("model.n_embd=1000000", "model.n_layer, model.n_embd"),
])
def test_a_run_that_cannot_fit_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch, override, part):
    def never(*args, **kwargs):
        raise AssertionError("the model was built: the check came too late")

    monkeypatch.setattr(GPT, "__init__", never)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("all the world's a stage\n" * 100_000, encoding="utf-8")  # windows of 100,000 fit
    out = tmp_path / "out"
    args = ["--config", TINY, *tiny_overrides(corpus, out), override]
    if override.startswith("model.n_embd"):
        args.append("model.n_head=1")
    assert train.main(args, progress=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this run needs about ") and part in err[0], err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize(("model", "texts"), [(["model.type=bigram"], 3), ([], 2)])
def test_a_run_whose_vocabulary_makes_its_need_is_told_of_data_max_vocab(tmp_path, capsys, model, texts):
    """A bigram table of 147,952 x 147,952 characters, or the logits of 1,112,032 characters at every position (a
    text of every character Unicode has), told to use a smaller model.n_layer or model.n_embd: neither helps."""
    last = 0x110000 if not model else 0x20 + 150_000
    text = "".join(chr(c) for c in range(0x20, last) if not 0xD800 <= c <= 0xDFFF)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text * texts, encoding="utf-8")
    batch = [] if model else ["train.batch_size=2000"]
    assert train.main(["--config", TINY, *tiny_overrides(corpus, tmp_path / "out"), *model, *batch],
                      progress=False) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: this run needs about ") and line.endswith(
        f"free; use a smaller vocabulary (data.max_vocab=N keeps the N most frequent characters; this one has "
        f"{len(text):,})")


@pytest.mark.parametrize(("batch", "peak"), [(16, 3.73e9), (32, 5.98e9)])
def test_the_estimate_is_above_a_huge_vocabularys_logits_and_their_gradients(batch, peak):
    # peak memory of train.py with tiny.yaml's model on a text of 1,112,032 characters (2026-12-02, eager, float32,
    # the weights' average on): counted as 3.42 and 5.13 GB, and batch 64 (10.46 GB) as 8.56
    cfg = replace(load_config(TINY, []).model, vocab_size=1_112_032)
    assert training_need(cfg, batch, 1, averaged=True).total > peak


# train.py run with its address space limited to what it has mapped once torch is loaded, plus 1 GiB (ulimit -v)
UNDER_A_LIMIT = """
import resource, sys
sys.path.insert(0, sys.argv[1])
import torch, train
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
raise SystemExit(train.main(sys.argv[2:], progress=False))
"""


def test_a_run_past_the_process_s_own_memory_limit_is_refused_in_one_line(tmp_path) -> None:
    """ulimit -v (or -d) was not counted: a run that fit the machine's free memory but not the process's limit went
    on to the allocator, and ended in its traceback."""
    out = tmp_path / "out"
    args = ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out), "model.n_layer=3", "model.n_embd=64",
            "train.batch_size=20000"]  # about 3.6 GB, of which a step takes some 3
    done = subprocess.run([sys.executable, "-c", UNDER_A_LIMIT, str(ROOT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this run needs about 3."), err
    assert re.search(r"of memory and this process's memory limit \(ulimit -v or -d\) leaves (0\.\d|1\.[01]) GB; raise "
                     r"the limit in the shell that starts it \(the machine has [\d,.]+ GB free\)$", err[0]), err
    assert not out.exists()


def test_the_process_s_own_limits_count_only_where_they_are_set(monkeypatch) -> None:
    import resource

    unlimited = {resource.RLIMIT_AS: resource.RLIM_INFINITY, resource.RLIMIT_DATA: resource.RLIM_INFINITY}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (unlimited.get(which, 0), resource.RLIM_INFINITY))
    assert training.memory.process_limit_available() is None
    unlimited[resource.RLIMIT_DATA] = 1  # below what the process already uses: nothing left, not a negative
    assert training.memory.process_limit_available() == 0
    unlimited[resource.RLIMIT_DATA] = 1 << 50
    assert 0 < training.memory.process_limit_available() < 1 << 50


def test_a_need_too_large_for_a_float_is_said_in_bounded_words(monkeypatch) -> None:
    # 10**400 bytes: n / 1e9 raised OverflowError; the number itself would be 400 digits
    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 23 * 10**9)
    cpu = torch.device("cpu")
    for processes in (1, 2):
        with pytest.raises(UsageError) as info:
            check_fits(MemoryNeed(weights=10**400, masks=0, activations=0), cpu, processes=processes)
        assert str(info.value).startswith("this run needs more than 1,000,000,000,000,000.0 GB of memory and this "
                                          "machine has 23.0 GB free; use a smaller model")
    with pytest.raises(UsageError, match=r"needs about 1,000,000,000,000,000.0 GB of memory"):  # the bound itself
        check_fits(MemoryNeed(weights=10**24, masks=0, activations=0), cpu)
    with pytest.raises(UsageError, match=r"needs about 500 processes x 50 MB of memory and this machine has 23.0 GB"):
        check_fits(MemoryNeed(weights=0, masks=0, activations=50 * 10**6), cpu, processes=500)


@pytest.mark.parametrize(("override", "says"), [
    (f"model.n_layer={2**63 - 1}", "this run needs more than 1,000,000,000,000,000.0 GB "),
    (f"train.batch_size={2**63 - 1}", "this run needs about "),
    (f"model.n_layer={10**400}", "model.n_layer must be at most 2**63 - 1, got 1"),  # past 64 bits: the config's
    (f"train.batch_size={10**400}", "train.batch_size must be at most 2**63 - 1, got 1"),
], ids=["n_layer", "batch_size", "n_layer-past-64-bits", "batch_size-past-64-bits"])
def test_a_config_of_astronomical_size_is_one_short_line(tmp_path, capsys, override, says):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("all the world's a stage\n" * 1000, encoding="utf-8")
    out = tmp_path / "out"
    assert train.main(["--config", TINY, *tiny_overrides(corpus, out), override], progress=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert len(err[0]) < 300 and not out.exists()


def test_a_bigram_models_need_is_its_logits_not_a_gpts_layers():
    """model.type=bigram block_size=4096 batch_size=64 was refused as needing 211.8 GB, with advice to shrink
    model.n_layer (which a bigram has not); it trains with a peak of 0.61 GB, torch's own 0.3 among it."""
    cfg = GPTConfig(type="bigram", vocab_size=65, block_size=4096)
    need = training_need(cfg, 64, 64)  # as measured: train.eval_iters=1, so one evaluation batch of 64
    assert 0.3e9 < need.total < 0.7e9  # above what the run took beyond torch's own, not far above
    assert need.total < training_need(replace(cfg, type="gpt", n_layer=1, n_embd=4, n_head=1), 64, 64).total / 5
