"""tinychar's C kernels in the eager training step (training/eager_kernels.py): which layers take them and when, that
it is they that run, with PyTorch's losses to rounding, and that a run with them resumes exactly, as it was trained."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, needs_cpu_compile, tiny_overrides

import train
from benchmark.runs import engine_of
from model import GPT, GPTConfig, load_checkpoint
from training import TrainConfig, attention_kernel, c_kernels, eager_kernels, gelu_kernel
from training.optim import make_optimizer

CPU = torch.device("cpu")
TINY = str(ROOT / "configs" / "tiny.yaml")


def tinychar_operators(profile: torch.profiler.profile) -> dict[str, int]:
    return dict(Counter(e.name.removeprefix("tinychar::") for e in profile.events()
                        if e.name.startswith("tinychar::")))


def three_eager_steps(m: GPT, optimizer: torch.optim.Optimizer, xs: torch.Tensor) -> tuple[list[float], dict[str, int]]:
    """Three eager steps of m on xs (the next characters as targets): their losses, and tinychar's operators that
    ran."""
    losses = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(3):
            _, loss = m(xs, xs.roll(1, -1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses, tinychar_operators(profile)


def taken(model: GPT) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "kernel_eager", False) and m.kernel is not None]


def test_a_run_takes_them_on_a_cpu_in_float32_when_long_enough_or_as_its_checkpoint_was_trained():
    long, short = eager_kernels.MIN_STEPS, eager_kernels.MIN_STEPS - 1
    assert eager_kernels.wanted("auto", CPU, torch.float32, False, long, None)
    assert eager_kernels.wanted("true", CPU, torch.float32, False, long, None)  # true, where compiling cannot be
    assert not eager_kernels.wanted("auto", CPU, torch.float32, False, short, None)  # a second of g++ not won back
    assert not eager_kernels.wanted("false", CPU, torch.float32, False, long, None)  # no compiler of any kind
    assert not eager_kernels.wanted("auto", CPU, torch.bfloat16, False, long, None)
    assert not eager_kernels.wanted("auto", torch.device("cuda"), torch.float32, False, long, None)
    assert not eager_kernels.wanted("auto", CPU, torch.float32, True, long, None)  # under torchrun: not measured
    # a resume goes on as it was trained, however few its steps, and however many
    assert eager_kernels.wanted("auto", CPU, torch.float32, False, 1, {"kernels": "attention"})
    assert not eager_kernels.wanted("auto", CPU, torch.float32, False, 10**6, {"engine": "eager"})


def model(width: int = 64, block: int = 8, dropout: float = 0.0) -> GPT:
    return GPT(GPTConfig(vocab_size=65, block_size=block, n_layer=1, n_head=width // 16, n_embd=width,
                         dropout=dropout))


@needs_cpu_compile
def test_the_layers_that_take_them_eagerly(monkeypatch):
    """With TINYCHAR_GEMM=1 (the linear layers' kernel on any CPU): tiny.yaml's model at its 1,024 rows a step takes all
    three, the linear layers' only from EAGER_MIN_MACS (c_fc and the MLP's c_proj, 16.8 million; not the 12.6 of c_attn
    nor the 4.2 of the attention's c_proj, measured no faster eagerly); at 512 rows the attention and GELU (131,072
    values a call); at 128 the attention alone (its least work, 65,536); bench.py's block-8 model (heads of 8) none, nor
    dropout's attention."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    m = model()
    assert eager_kernels.attach(m, 1024) == ["attention", "GELU", "linear"] == eager_kernels.attached(m)
    assert taken(m) == ["transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.0.mlp.c_fc",
                        "transformer.h.0.mlp.c_proj"]
    m = model()
    assert eager_kernels.attach(m, 512) == ["attention", "GELU"] and taken(m) == ["transformer.h.0.attn",
                                                                                 "transformer.h.0.mlp"]
    m = model()
    assert eager_kernels.attach(m, 128) == ["attention"] and taken(m) == ["transformer.h.0.attn"]
    assert eager_kernels.attach(model(), 127) == []
    m = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=3, n_head=4, n_embd=32, dropout=0.0))
    assert eager_kernels.attach(m, 256) == [] and taken(m) == []
    m = model(dropout=0.1)
    assert "attention" not in eager_kernels.attach(m, 1024)
    monkeypatch.setenv("TINYCHAR_GEMM", "0")  # PyTorch's products, as TINYCHAR_GEMM asks, eagerly too
    assert eager_kernels.attach(model(), 1024) == ["attention", "GELU"]


@needs_cpu_compile
def test_the_eager_step_runs_them_with_pytorchs_losses_and_builds_no_cpp(monkeypatch):
    """Three AdamW steps of a model small enough to take all three only with their least work at 0: each kernel ran
    forward and backward, the losses within 2e-6 of PyTorch's own code and all but a few weights within 1e-6 (as the
    compiled step's test bounds it: where a gradient is near zero the order of additions can tip a first step). The
    operators' C++ is never built for it (through Python, as fast eagerly, and 1.3-1.5 s of g++ less)."""
    monkeypatch.setattr(attention_kernel, "MIN_WORK", (0, 0))
    monkeypatch.setattr(gelu_kernel, "MIN_VALUES", (0, 0))
    monkeypatch.setattr(eager_kernels, "EAGER_MIN_MACS", 0)
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    def no_cpp(*args, **kwargs):
        pytest.fail("the eager step built or loaded the operators' C++")
    monkeypatch.setattr(c_kernels, "operators", no_cpp)
    monkeypatch.setattr(attention_kernel, "operators", no_cpp)
    cfg = GPTConfig(vocab_size=12, block_size=16, n_layer=1, n_head=1, n_embd=16, dropout=0.0)
    xs = torch.randint(0, 12, (4, 16), generator=torch.Generator().manual_seed(0))

    def three_steps(kernels: bool) -> tuple[GPT, list[float], torch.Tensor, dict[str, int]]:
        torch.manual_seed(0)
        m = GPT(cfg)
        if kernels:
            assert eager_kernels.attach(m, 4 * 16) == ["attention", "GELU", "linear"]
        losses, ran = three_eager_steps(m, make_optimizer(m, TrainConfig(), CPU), xs)
        return m, losses, torch.cat([p.detach().flatten() for p in m.parameters()]), ran

    _, plain_losses, plain_weights, plain_ran = three_steps(kernels=False)
    m, losses, weights, ran = three_steps(kernels=True)
    assert plain_ran == {}
    assert ran == {name: 3 for name in ("causal_attention", "causal_attention_backward", "gelu")} | {
        "linear": 3 * 4, "linear_backward": 3 * 4}  # a block's four layers (the head over 12 characters keeps MKL)
    assert losses == pytest.approx(plain_losses, abs=2e-6)
    apart = (weights - plain_weights).abs()
    assert 0 < apart.max() < 1e-3 and int((apart > 1e-6).sum()) <= apart.numel() // 100
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        m(xs)  # evaluation and sampling keep PyTorch's code
    assert tinychar_operators(profile) == {}


def kernel_run(corpus: Path, out: Path, **extra: object) -> list[str]:
    """An eager run (auto, with the compile cache's helper off) of a model whose attention takes the kernel: block 16,
    heads of 16, 32 sequences a step (8,192 positions x 32 wide, over its least work)."""
    return tiny_overrides(corpus, out, **{"train.compile": "auto", "model.block_size": 16, "model.n_embd": 32,
                                          "model.n_layer": 1, "train.batch_size": 32, "train.lr_decay_iters": 20,
                                          "train.log_interval": 1, "train.sample_chars": 0, **extra})


@needs_cpu_compile
def test_a_run_with_them_resumes_exactly_as_it_was_trained(tmp_path, capsys, monkeypatch):
    """A run long enough takes the kernels and says so (the attention's, and Muon's iteration's, TINYCHAR_GEMM=1 on any
    CPU); stopped at step 15 and resumed (5 steps left, too few for a fresh run) it takes them again, as its checkpoint
    records, and ends with the straight run's weights to the bit; train.compile=false, on either, trains with
    PyTorch's code, whose weights differ (the control), and a resume so says it goes on inexactly."""
    monkeypatch.setattr(eager_kernels, "MIN_STEPS", 15)
    monkeypatch.setenv("TINYCHAR_WARM_CACHE", "0")
    monkeypatch.setenv("TINYCHAR_GEMM", "1")  # Muon's kernel (tiny.yaml's optimizer) on any CPU
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    straight, half, plain = tmp_path / "straight", tmp_path / "half", tmp_path / "plain"
    assert train.main(["--config", TINY, *kernel_run(corpus, straight)], progress=False) == 0
    said = capsys.readouterr().out
    assert "; tinychar's kernels for attention, Muon (" in said
    assert [engine_of(line) for line in said.splitlines() if engine_of(line)] == ["eager with its kernels"]  # bench.py
    assert load_checkpoint(straight / "ckpt.pt")["settled"]["kernels"] == "attention, Muon"
    assert train.main(["--config", TINY, *kernel_run(corpus, half, **{"train.max_iters": 15})], progress=False) == 0
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(half), "train.max_iters=20"], progress=False) == 0
    said = capsys.readouterr().out
    assert "tinychar's kernels for attention, Muon" in said and "no longer bit-identical" not in said
    resumed, whole = load_checkpoint(half / "ckpt.pt"), load_checkpoint(straight / "ckpt.pt")
    assert resumed["step"] == whole["step"] == 20
    assert all(torch.equal(resumed["training_weights"][k], v) for k, v in whole["training_weights"].items())
    assert train.main(["--config", TINY, *kernel_run(corpus, plain, **{"train.compile": "false"})], progress=False) == 0
    said = capsys.readouterr().out
    assert "tinychar's kernels" not in said and "kernels" not in load_checkpoint(plain / "ckpt.pt")["settled"]
    weights = load_checkpoint(plain / "ckpt.pt")["training_weights"]
    assert not all(torch.equal(weights[k], v) for k, v in whole["training_weights"].items())
    assert train.main(["--resume", "--out-dir", str(straight), "train.max_iters=25", "train.compile=false"],
                      progress=False) == 0
    assert "its setup differs from the saved run's (kernels attention, Muon -> None)" in capsys.readouterr().out
