"""The compiled engine (training.engine): when train.compile=auto compiles, the compiled whole step against the eager
one and exact resume under it in real runs, the one-line fallback where compiling is not possible, and the compiled
CUDA step after a release of PyTorch's GPU cache. One model shape throughout (one layer: the compile is the slow
part), so the session compiles once (~15 s) and the later runs reuse the compiled code; test_training_compiled_step.py
tests the step itself."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SMALL_TEXT, needs_cpu_compile, tiny_overrides
from test_train import bitwise_equal, logged_losses
from training_runs import call, train_main, write_corpus

from benchmark.runs import engine_of
from data import CharTokenizer
from model import GPT, GPTConfig, linear, load_checkpoint
from sampling.compiling import sampling_key
from training import c_kernels, compile_cache, compile_errors, engine, load_config
from training.compiled_step import CompiledStep
from training.config import TrainConfig
from training.engine import (
    COLD_MIN_STEPS,
    CUDA_MIN_STEPS,
    CUDA_WARM_MIN_STEPS,
    OVERHEAD_BOUND_FLOPS,
    WARM_MIN_STEPS,
    auto_compiles,
)
from training.optim import make_optimizer

CPU = torch.device("cpu")
# The schedule does not depend on max_iters (lr_decay_iters), so a run of 10 steps resumed to 20 is the run of 20.
ENGINE_KEYS = {"model.n_layer": 1, "train.lr_decay_iters": 20, "train.log_interval": 1, "train.grad_accum_steps": 2,
               "train.sample_chars": 0, "train.tensorboard": "false"}
# Compiled and eager steps add and fuse in another order: float32 rounding, then AdamW's normalised updates, let
# the two runs drift apart slowly. Measured after 20 steps of this model (lr 1e-2; each step moves a weight by up
# to ~1e-2): the logged losses equal to their 4 decimals, the weights within 9e-5 with AdamW alone and 8e-6 with
# tiny.yaml's Muon. The bounds leave room for a last digit rounded the other way; a wrong update (a missing bias
# correction, weight decay or momentum) is off by far more.
LOSS_TOLERANCE = 5e-4
WEIGHT_TOLERANCE = 5e-4


def test_auto_weighs_the_compile_by_the_micro_batches_the_step_unrolls():
    small = OVERHEAD_BOUND_FLOPS / 10
    assert auto_compiles(small, 4 * COLD_MIN_STEPS, CPU, warm=False, micro_batches=4)[0]
    wanted, reason = auto_compiles(small, 4 * COLD_MIN_STEPS - 1, CPU, warm=False, micro_batches=4)
    assert not wanted and f"auto compiles from {4 * COLD_MIN_STEPS:,}: {COLD_MIN_STEPS:,} for each of 4" in reason


def test_auto_compiles_only_where_the_run_wins_the_compile_time_back():
    small = OVERHEAD_BOUND_FLOPS / 10
    assert auto_compiles(small, COLD_MIN_STEPS, CPU, warm=False)[0]
    assert not auto_compiles(small, COLD_MIN_STEPS - 1, CPU, warm=False)[0]
    assert auto_compiles(small, WARM_MIN_STEPS, CPU, warm=True)[0]
    wanted, reason = auto_compiles(small, WARM_MIN_STEPS - 1, CPU, warm=True)
    assert not wanted and "too few" in reason and "train.compile=true" in reason
    # a step bound by its matrix multiplies gains nothing from compiling on a CPU, however long the run
    wanted, reason = auto_compiles(OVERHEAD_BOUND_FLOPS * 2, 10**9, CPU, warm=True)
    assert not wanted and "matrix multiplies" in reason
    # ... unless they run through oneDNN, which halves them, and compiling removes most of what is left
    assert auto_compiles(OVERHEAD_BOUND_FLOPS * 2, COLD_MIN_STEPS, CPU, warm=False, onednn=True)[0]
    assert not auto_compiles(OVERHEAD_BOUND_FLOPS * 2, COLD_MIN_STEPS - 1, CPU, warm=False, onednn=True)[0]
    assert auto_compiles(OVERHEAD_BOUND_FLOPS * 2, WARM_MIN_STEPS, CPU, warm=True, onednn=True)[0]
    # on CUDA compiling pays at any size, from CUDA_MIN_STEPS cold and CUDA_WARM_MIN_STEPS warm
    cuda = torch.device("cuda")
    assert auto_compiles(OVERHEAD_BOUND_FLOPS * 2, CUDA_MIN_STEPS, cuda, warm=False)[0]
    assert not auto_compiles(OVERHEAD_BOUND_FLOPS * 2, CUDA_MIN_STEPS - 1, cuda, warm=False)[0]
    assert auto_compiles(OVERHEAD_BOUND_FLOPS * 2, CUDA_WARM_MIN_STEPS, cuda, warm=True)[0]
    assert not auto_compiles(OVERHEAD_BOUND_FLOPS * 2, CUDA_WARM_MIN_STEPS - 1, cuda, warm=True)[0]
    assert CUDA_WARM_MIN_STEPS < CUDA_MIN_STEPS


def test_with_a_warm_cache_auto_weighs_the_saving_measured_here_against_the_compile():
    """The counts of steps are one CPU's (on a Zen 1, tiny.yaml's 1,500 steps win back a compile from the warm cache;
    on a Zen 4, not): where the helper timed the step eagerly and compiled, auto compiles iff the steps left times the
    saving come to MEASURED_MARGIN times the compile from the warm cache."""
    small, margin = OVERHEAD_BOUND_FLOPS / 10, engine.MEASURED_MARGIN
    zen1 = (42.6, 30.4, 7.7)  # the helper's measurement of tiny.yaml on a Zen 1, and its compile from the cache
    wanted, reason = auto_compiles(small, 1_500, CPU, warm=True, measured=zen1)
    assert wanted, reason
    assert reason == ("measured here, a step takes 42.6 ms eager and 30.4 ms compiled: 1,500 steps win back 18.3 s, "
                      f"over {margin:g}x the 7.7 s of a compile from the warm cache")
    needed = math.ceil(margin * 7.7 / 0.0122)  # the fewest steps whose saving comes to the margin times the compile
    assert auto_compiles(small, needed, CPU, warm=True, measured=zen1)[0]
    wanted, reason = auto_compiles(small, needed - 1, CPU, warm=True, measured=zen1)
    assert not wanted and "less than" in reason and "train.compile=true forces it" in reason
    # a step that compiling makes no faster never compiles, however long the run: above WARM_MIN_STEPS too
    wanted, reason = auto_compiles(small, 10**9, CPU, warm=True, measured=(10.0, 10.5, 2.2))
    assert not wanted and "would win back 0.0 s" in reason
    # the saving decides only from a warm cache: cold, the counts do (the helper warms it)
    assert not auto_compiles(small, 1_500, CPU, warm=False, measured=zen1)[0]
    # a step over the FLOPs of OVERHEAD_BOUND_FLOPS, held eager by that rule until measured, is then measured too:
    # nanoGPT's CPU config in float32 on a Xeon with AMX, 44 ms eager and 31 compiled, 2,000 steps, a 6 s compile
    bound, xeon = OVERHEAD_BOUND_FLOPS * 2, (44.0, 31.0, 6.0)
    assert not auto_compiles(bound, 10**9, CPU, warm=False, measured=xeon)[0]
    assert not auto_compiles(bound, 10**9, CPU, warm=True)[0]
    wanted, reason = auto_compiles(bound, 2_000, CPU, warm=True, measured=xeon)
    assert wanted and reason.startswith("measured here, a step takes 44.0 ms eager and 31.0 ms compiled"), reason
    assert not auto_compiles(bound, 10**9, CPU, warm=True, measured=(28.0, 28.0, 2.3))[0]  # a Zen 4's: no gain


def test_a_step_multiplies_through_onednn_when_a_linear_layer_takes_its_rows_there(monkeypatch):
    monkeypatch.setenv("TINYCHAR_ONEDNN", "0")
    assert not engine.multiplies_through_onednn(GPT(GPTConfig(vocab_size=5, n_layer=1)), 10**6)
    monkeypatch.setenv("TINYCHAR_ONEDNN", "auto")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(linear, "onednn_outruns_blas", lambda: True)
    model = GPT(GPTConfig(vocab_size=5, n_layer=1, n_embd=128, n_head=4, block_size=64))
    # c_fc, 128 -> 512, is the widest: 2**21 multiply-adds from 32 rows
    assert not engine.multiplies_through_onednn(model, 31)
    assert engine.multiplies_through_onednn(model, 32)


def test_under_bfloat16_a_cpu_steps_multiplies_run_through_onednn_so_compiling_may_pay_at_any_size(monkeypatch):
    """bfloat16 autocast sends every CPU product to oneDNN (with AMX, 4x float32's speed), which leaves the step to
    its other operators: auto weighs compiling as for any overhead-bound step, whatever its FLOPs."""
    monkeypatch.setenv("TINYCHAR_ONEDNN", "0")  # float32 keeps PyTorch's BLAS: bound by its multiplies at this size
    model = GPT(GPTConfig(vocab_size=5, n_layer=1, n_embd=128, n_head=4, block_size=64))
    assert not engine.multiplies_outside_blas(model, 768, CPU, torch.float32)
    assert engine.multiplies_outside_blas(model, 768, CPU, torch.bfloat16)
    assert not engine.multiplies_outside_blas(model, 768, torch.device("cuda"), torch.bfloat16)  # no BLAS rule there
    bound = OVERHEAD_BOUND_FLOPS * 2
    onednn = engine.multiplies_outside_blas(model, 768, CPU, torch.bfloat16)
    assert not auto_compiles(bound, 10**9, CPU, warm=True, onednn=False)[0]
    assert auto_compiles(bound, 2_000, CPU, warm=True, onednn=onednn, measured=(32.0, 21.0, 10.0))[0]


def test_the_compiled_steps_are_timed_apart_with_and_without_the_own_gemm(monkeypatch):
    """A step compiled with training/linear_kernel.py's products runs at another speed than one through the BLAS, so
    --compile auto's timings of each (kept under these keys) are kept apart on a CPU; on CUDA the setting changes
    nothing."""
    tc, cfg, cuda = TrainConfig(), GPTConfig(vocab_size=5), torch.device("cuda")

    def keys(setting: str, device: torch.device) -> tuple[str, str]:
        monkeypatch.setenv("TINYCHAR_GEMM", setting)
        return (engine.compile_key(cfg, tc, device, torch.float32),
                sampling_key(cfg, 1, 0.8, None, None, device))

    own, blas = keys("1", CPU), keys("0", CPU)
    assert own[0] != blas[0] and own[1] != blas[1]
    assert keys("auto", CPU) == (own if linear.own_gemm_wanted() else blas)
    assert keys("1", cuda) == keys("0", cuda)


def test_without_a_compiler_a_forced_compile_trains_eagerly_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(c_kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    overrides = tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **{"train.compile": "true",
                                                                            "train.max_iters": 2})
    code, out, err = call(train_main, overrides, capsys)
    assert code == 0, err
    assert "engine: eager (train.compile=true, but no C++ compiler found" in out
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["engine"] == "eager"


@pytest.mark.parametrize("kind, dtype", [("gru", "float32"), ("gru", "float16"), ("lstm", "float32")],
                         ids=["whole-step", "block-by-block", "lstm"])
def test_a_gru_with_compile_true_says_it_trains_eagerly_without_trying(tmp_path, capsys, monkeypatch, kind, dtype):
    """torch.compile refuses PyTorch's GRU: the whole step tried (seconds), failed, and said "cannot compile here
    (Unsupported: Attempted to wrap RNN, GRU, or LSTM)", as if the machine were at fault; the block-by-block path
    (float16, torchrun) said "model compiled block by block" and compiled nothing."""
    def compiling(*args, **kwargs):
        raise AssertionError("tried to compile a GRU")

    monkeypatch.setattr(CompiledStep, "warm_up", compiling)
    import training.runner

    monkeypatch.setattr(training.runner, "compile_blocks", compiling)
    monkeypatch.setattr(engine, "cannot_compile", lambda device: None)  # a C++ compiler or not, the same answer
    overrides = tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **{
        "model.type": kind, "train.compile": "true", "train.dtype": dtype, "train.max_iters": 2})
    code, out, err = call(train_main, overrides, capsys)
    assert code == 0, err
    assert (f"engine: eager (train.compile=true, but torch.compile does not compile a {kind} model (PyTorch's "
            f"{kind.upper()}): training without compiling)") in out
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["engine"] == "eager"


def test_a_failed_compile_is_one_line_naming_the_error_underneath_and_torch_s_log_of_it_stays_quiet(
        tmp_path, capfd, monkeypatch):
    """A compile that failed in a fake-tensor kernel printed a page of torch's log (the kernel logs the traceback,
    then raises), then "cannot compile here (TorchRuntimeError: RuntimeError when making fake tensor call)", which did
    not say what the call met. Staged here without compiling: warm_up fails as that compile did."""
    import logging

    def failing(self, xs, ys):
        try:
            raise RuntimeError("expected scalar type torch.float32 but found torch.bfloat16")
        except RuntimeError:
            logging.getLogger("torch._subclasses.fake_tensor").exception("failed while attempting to run meta")
            try:
                raise ValueError("RuntimeError when making fake tensor call") from None
            except ValueError as e:
                raise TypeError("RuntimeError when making fake tensor call\n  Explanation: ...") from e

    monkeypatch.setattr(engine, "cannot_compile", lambda device: None)  # a compiler or not: none runs
    monkeypatch.setattr(CompiledStep, "warm_up", failing)
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    overrides = tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **{"train.compile": "true",
                                                                            "train.max_iters": 2})
    capfd.readouterr()
    try:
        assert train_main(overrides) == 0
    finally:
        log.removeHandler(handler)
    out, err = capfd.readouterr()
    assert "failed while attempting" not in out + err and "Traceback" not in out + err, err
    assert not logged  # nor through any handler
    assert ("engine: cannot compile here (TypeError: RuntimeError when making fake tensor call; from RuntimeError: "
            "expected scalar type torch.float32 but found torch.bfloat16); training without compiling") in out
    assert engine_read_by_the_bench(out) == "eager"
    assert not logging.getLogger("torch._subclasses.fake_tensor").disabled  # as it was, after the compile


@contextlib.contextmanager
def logged_by(name: str) -> Iterator[tuple[logging.Logger, list[logging.LogRecord]]]:
    """The logger of that name, and the records that pass its filters to its handlers while inside."""
    log, logged = logging.getLogger(name), []
    handler = logging.Handler()
    handler.emit = logged.append
    log.addHandler(handler)
    try:
        yield log, logged
    finally:
        log.removeHandler(handler)


def test_unreadable_entries_of_the_compile_cache_are_one_line_not_a_traceback_each(capfd, monkeypatch):
    """A damaged compile cache (its files overwritten) trained as it should, after 21 lines of torch's warnings and
    tracebacks, one for each graph it could not read and compiled again. Staged with inductor's own warning."""
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    capfd.readouterr()
    with logged_by("torch._inductor.codecache") as (log, logged), compile_errors.compiler_log_quiet():
        for _ in range(3):
            try:
                raise ValueError("invalid load key, 'x'.")
            except ValueError:
                log.warning("fx graph cache unable to load compiled graph", exc_info=True)
        log.warning("another warning of inductor's cache")
    err = capfd.readouterr().err
    assert "Traceback" not in err and "unable to load" not in err
    assert [r.getMessage() for r in logged] == ["another warning of inductor's cache"]  # the others pass
    assert err.endswith("compile cache: 3 compiled graph(s) in it could not be read (damaged files?), and were "
                        "compiled again\n")
    assert not log.filters  # as it was, after the compile


def test_an_artifact_inductor_cannot_load_is_not_logged_before_the_one_line(capfd, monkeypatch):
    """A compile cache whose 'locks' is a file: three lines of "E1203 ... Failed to load artifact: ..." from torch's
    log came before the one line that says the compile failed (inductor logs the error, then raises it)."""
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    with logged_by("torch._inductor.output_code") as (log, logged), compile_errors.compiler_log_quiet():
        log.error("Failed to load artifact: %s", "/cache/iu/ciuwpn.py")
        log.error("another error of inductor's")
    assert [r.getMessage() for r in logged] == ["another error of inductor's"]
    assert not log.filters


@needs_cpu_compile
def test_the_logs_sample_and_attention_run_the_block_compiled_model_eagerly(tmp_path, capsys, monkeypatch):
    # Nine micro-batches a step: more than the compiled step unrolls, so the blocks are compiled one by one, as
    # under DDP. The evaluation's sample and attention picture call the blocks with a KV cache, a layer index and
    # weights asked for; compiled, each layer and position was a compile of its own until dynamo's limit (4 steps
    # with a 40-character sample: 56.5 s, against 6.2 s eagerly).
    from torch._dynamo.utils import counters

    import training.loop
    from training.logger import Logger

    compiled_during: list[str] = []
    called: list[str] = []

    def watched(name, real):
        def run(*args, **kwargs):
            called.append(name)
            before = counters["frames"]["total"]
            result = real(*args, **kwargs)
            if counters["frames"]["total"] != before:
                compiled_during.append(name)
            return result
        return run

    monkeypatch.setattr(training.loop, "sample_text", watched("sample", training.loop.sample_text))
    monkeypatch.setattr(Logger, "attention", watched("attention", Logger.attention))
    # What dynamo traces and when is the subject, not the code inductor makes of it: the blocks' graphs go to
    # AOTAutograd's eager backend, which traces the same frames without building C++ (23 s -> 3 s for this test).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *args, **kwargs: compile_module(self, *args, **{**kwargs, "backend": "aot_eager"}))
    keys = {**ENGINE_KEYS, "train.compile": "true", "train.grad_accum_steps": engine.MAX_STEP_ACCUM + 1,
            "train.max_iters": 2, "train.eval_interval": 2, "train.sample_chars": 20, "train.tensorboard": "true"}
    code, out, err = call(train_main, tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **keys), capsys)
    assert code == 0, err
    assert "engine: model compiled block by block" in out
    assert called == ["sample", "attention"]  # the evaluation at step 2 drew both: the check below is not vacuous
    assert compiled_during == []


@pytest.mark.parametrize("compiler", ["fails", "works"])
def test_the_block_by_block_path_compiles_before_training_and_falls_back_to_eager_in_one_line(
        tmp_path, capsys, monkeypatch, compiler):
    """Under float16 (and torchrun) the blocks compiled lazily, in the first step: a compiler failure (an old GPU
    that Triton does not support, say) ended the run in a BackendCompilerFailed traceback, where the whole step falls
    back to eager. They now compile on one batch before training, which leaves the run as it was: the losses are the
    eager run's, to the bit, whatever became of the compile."""
    def failing(gm, example_inputs):
        raise RuntimeError("no kernels for this GPU (staged)")

    # what is traced and whether it fails is the subject, not inductor's code: AOTAutograd's eager backend, which
    # runs the traced operators as they are, so the losses stay the eager run's
    backend = failing if compiler == "fails" else "aot_eager"
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *args, **kwargs: compile_module(self, *args, **{**kwargs, "backend": backend}))
    monkeypatch.setattr(engine, "cannot_compile", lambda device: None)  # a C++ compiler or not: inductor never runs
    keys = {"train.dtype": "float16", "train.max_iters": 3, "model.dropout": 0.1}
    corpus = write_corpus(tmp_path)
    out, losses = run_losses(corpus, tmp_path / "compiled", capsys, **keys, **{"train.compile": "true"})
    if compiler == "fails":
        assert ("engine: eager (train.compile=true, but cannot compile here (BackendCompilerFailed: backend='failing' "
                "raised; from RuntimeError: no kernels for this GPU (staged)): training without compiling)") in out
        assert load_checkpoint(tmp_path / "compiled" / "ckpt.pt")["engine"] == "eager"
    else:
        assert re.search(r"engine: model compiled block by block \(train.compile=true; compiled in [0-9.]+ s\)", out)
    assert engine_read_by_the_bench(out) == ("eager" if compiler == "fails" else "compiled block by block")
    _, eager = run_losses(corpus, tmp_path / "eager", capsys, **keys, **{"train.compile": "false"})
    assert losses == eager and len(losses) == 3


def engine_read_by_the_bench(out: str) -> str | None:
    """The engine bench.py's races report for a run that printed out (benchmark.runs.engine_of, its last say)."""
    return next((e for e in map(engine_of, reversed(out.splitlines())) if e is not None), None)


def run_losses(corpus: Path, out: Path, capsys, *extra: str, **keys: object) -> tuple[str, dict[int, str]]:
    code, stdout, err = call(train_main, [*tiny_overrides(corpus, out, **{**ENGINE_KEYS, **keys}), *extra], capsys)
    assert code == 0, err
    return stdout, logged_losses(stdout)


@needs_cpu_compile
@pytest.mark.slow
def test_compiled_step_agrees_with_eager_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    # Every product of the model through oneDNN (model/linear.py), as a large model's are on an AVX-512 CPU: its
    # gradients inside the compiled step's torch.func transform, and its operator called from compiled code.
    monkeypatch.setenv("TINYCHAR_ONEDNN", "1" if torch.backends.mkldnn.is_available() else "0")
    corpus = write_corpus(tmp_path)
    out, eager = run_losses(corpus, tmp_path / "eager", capsys, **{"train.compile": "false"})
    assert engine_read_by_the_bench(out) == "eager"
    out, compiled = run_losses(corpus, tmp_path / "compiled", capsys, **{"train.compile": "true"})
    assert "engine: compiled in" in out and engine_read_by_the_bench(out) == "compiled"
    assert eager.keys() == compiled.keys() == set(range(1, 21))
    assert max(abs(float(eager[s]) - float(compiled[s])) for s in eager) < LOSS_TOLERANCE
    eager_w = load_checkpoint(tmp_path / "eager" / "ckpt.pt")["model"]
    compiled_ckpt = load_checkpoint(tmp_path / "compiled" / "ckpt.pt")
    assert compiled_ckpt["engine"] == "compiled"
    assert max((eager_w[k] - compiled_ckpt["model"][k]).abs().max().item() for k in eager_w) < WEIGHT_TOLERANCE

    # Stopped at step 10 and resumed with train.compile=auto: the checkpoint says it was compiled, so the resumed
    # run compiles too (20 steps alone would not make auto compile) and ends bit for bit where the straight run did.
    run_losses(corpus, tmp_path / "resumed", capsys, **{"train.compile": "true", "train.max_iters": 10})
    out, resumed = run_losses(corpus, tmp_path / "resumed", capsys, "--resume", **{"train.compile": "auto"})
    assert "auto: as the checkpoint was trained (compiled)" in out
    assert {s: resumed[s] for s in range(11, 21)} == {s: compiled[s] for s in range(11, 21)}
    final = load_checkpoint(tmp_path / "resumed" / "ckpt.pt")
    assert bitwise_equal(final["model"], compiled_ckpt["model"])
    # Every parameter's optimizer state: AdamW's moments, and the momentum of Muon's matrices (tiny.yaml's optimizer)
    saved = compiled_ckpt["optimizer"]["state"]
    assert any("momentum_buffer" in state for state in saved.values())
    assert all(bitwise_equal(final["optimizer"]["state"][i], state) for i, state in saved.items())


def step_of_the_runs(tmp_path: Path) -> tuple[GPT, torch.optim.Optimizer, CompiledStep, torch.Tensor]:
    """A CompiledStep of the runs above (their shapes: their compiled code, which a step made after them in this process
    runs without compiling again), its model and optimizer, and a batch."""
    cfg = load_config(None, tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **ENGINE_KEYS))
    vocab = CharTokenizer.from_text(SMALL_TEXT).vocab_size
    torch.manual_seed(0)
    model = GPT(replace(cfg.model, vocab_size=vocab))
    optimizer = make_optimizer(model, cfg.train, CPU)
    step = CompiledStep(model, optimizer, cfg.train, CPU, torch.float32)
    return model, optimizer, step, torch.randint(0, vocab, (2, cfg.train.batch_size, 8))


@needs_cpu_compile
@pytest.mark.slow
def test_compiled_step_leaves_everything_untouched_when_the_loss_is_not_finite(tmp_path, monkeypatch):
    # Here, after the runs above, so that it takes their compiled step (a file of its own ran on another of pytest's
    # workers, which compiled it again: 25 s).
    monkeypatch.setenv("TINYCHAR_ONEDNN", "1" if torch.backends.mkldnn.is_available() else "0")  # as above
    model, optimizer, step, xs = step_of_the_runs(tmp_path)
    loss, norm = step(xs, xs.clone(), 1e-3)
    assert torch.isfinite(loss) and torch.isfinite(norm)
    with torch.no_grad():
        model.transformer.wte.weight[3] = float("inf")  # any batch holding character 3 now has a NaN loss
    xs[0, 0, 0] = 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    loss, norm = step(xs, xs.clone(), 1e-3)
    assert not torch.isfinite(loss)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(state_before[k], v) for k, v in optimizer.state_dict()["state"][0].items())


@pytest.fixture(scope="module")
def released_run(tmp_path_factory) -> tuple[int, str]:
    """configs/shakespeare_char.yaml compiled on CUDA for 300 steps, releasing PyTorch's GPU cache once, in the
    evaluation at step 250 (right after its sample): the run that found the fault (an H200, torch 2.11, where the
    training loss went from 2.07 at step 250 to 3.53 at step 252; with inductor's mix-order reduction off, as
    training.compile_cache.CUDA_OPTIONS has it since, this passed on an H100). (exit status, stdout)."""
    import contextlib
    import io

    import train
    from training import loop

    out = io.StringIO()
    real = loop.sample_text

    def sample_then_release(*args, **kwargs):  # as sample_text is called (the stop check among its keywords)
        text = real(*args, **kwargs)
        torch.cuda.empty_cache()
        return text

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(loop, "sample_text", sample_then_release)
        code = train.main(["--config", "configs/shakespeare_char.yaml", "--out-dir",
                           str(tmp_path_factory.mktemp("released")), "train.max_iters=300", "train.lr_decay_iters=5000",
                           "train.eval_interval=250", "train.log_interval=1"], progress=False)
    return code, out.getvalue()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_cuda_run_trains_on_unharmed_after_the_gpu_cache_is_released(released_run):
    code, out = released_run
    assert code == 0, out[-2000:]
    losses = {step: float(loss) for step, loss in logged_losses(out).items()}
    # Without the release the loss stays within a few hundredths of step 250's over the next ten steps (2.07 ->
    # 2.06-2.07 at step 260 in the runs measured); with it, it jumped by more than 1.
    assert max(losses[s] for s in range(251, 261)) < losses[250] + 0.3, {s: losses[s] for s in range(248, 261)}


def poison_cuda_cache(device: torch.device) -> None:
    """Leave PyTorch's CUDA cache full of NaN: blocks of many sizes, in both of its pools (under 1 MB, carved from
    2 MB segments; and the rest), filled and freed, so that a tensor allocated next from the cache reads NaN until
    it is written."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    big = 256 << 20
    counts = {512: 4096, 16 << 10: 1024, 256 << 10: 256, 2 << 20: 32, 32 << 20: 16, big: min(free // 2, 8 << 30) // big}
    blocks = [torch.full((size // 4,), float("nan"), device=device) for size, n in counts.items() for _ in range(n)]
    torch.cuda.synchronize(device)
    del blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_cuda_step_reads_no_memory_it_did_not_write():
    """The compiled step of configs/shakespeare_char.yaml's model on CUDA, from the same state and batches, with the
    cache released and refilled with NaN before each step: the same losses and weights as without. A kernel that read
    a buffer before writing it would read NaN here (inductor's mix-order reduction did, in the layer norms' weight
    gradients, until training.compile_cache turned it off): in the gradients' norm, since a step whose gradients are
    not finite leaves the weights as they were."""
    cuda = torch.device("cuda")
    cfg = load_config("configs/shakespeare_char.yaml", ["model.dropout=0.0"])
    torch.manual_seed(0)
    model = GPT(replace(cfg.model, vocab_size=65)).to(cuda)
    step = CompiledStep(model, make_optimizer(model, cfg.train, cuda), cfg.train, cuda, torch.bfloat16)
    batches = [torch.randint(65, (2, 1, cfg.train.batch_size, cfg.model.block_size), device=cuda,
                             generator=torch.Generator(device=cuda).manual_seed(i)) for i in range(3)]
    step.warm_up(batches[0][0], batches[0][1])
    start = [t.clone() for t in step.buffers()]

    def three_steps(poison: bool) -> tuple[list[float], torch.Tensor]:
        for buffer, value in zip(step.buffers(), start, strict=True):
            buffer.copy_(value)
        losses, norms = [], []
        for xs, ys in batches:
            if poison:
                poison_cuda_cache(cuda)
            loss, norm = step(xs, ys, 1e-3)
            losses.append(float(loss))
            norms.append(float(norm))
        return losses, norms, step.flat.clone()

    clean_losses, _, clean = three_steps(poison=False)
    poisoned_losses, poisoned_norms, poisoned = three_steps(poison=True)
    finite = all(math.isfinite(x) for x in poisoned_losses + poisoned_norms) and bool(torch.isfinite(poisoned).all())
    assert finite, (f"NaN after poisoning: a kernel read memory it had not written (losses {poisoned_losses}, "
                    f"gradient norms {poisoned_norms})")
    # The same arithmetic but for the order of CUDA's atomic adds (the embedding's gradient): rounding only.
    diff = float((poisoned - clean).abs().max())
    assert poisoned_losses == pytest.approx(clean_losses, rel=1e-3) and diff < 1e-3, (
        f"no NaN, yet the steps differ after the cache was released: losses {clean_losses} -> {poisoned_losses}, "
        f"weights by up to {diff:.3g}")


def test_a_compile_is_timed_with_the_compilers_imports(monkeypatch, tmp_path):
    """What train.compile=auto weighs a later compile by includes importing the compiler (about 1.2 s on a Zen 5),
    which only a compile needs: timed from the step's warm-up alone, a load of the step saved whole looked 1.2 s
    cheaper than it was. Staged without compiling: the imports take 0.2 s here, the warm-up nothing."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path))
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=8))
    tc = TrainConfig(batch_size=2)
    trainer = SimpleNamespace(model=model, tc=tc, device=CPU, dtype=torch.float32,
                              optimizer=make_optimizer(model, tc, CPU), splits={"train": torch.randint(0, 5, (64,))},
                              cfg=SimpleNamespace(model=model.config))
    monkeypatch.setattr(engine, "prepare_compile", lambda: time.sleep(0.2) or tmp_path)
    monkeypatch.setattr(CompiledStep, "warm_up", lambda self, xs, ys: 0.0)
    said: list[str] = []
    engine.start_engine(trainer, engine.EngineChoice("step", "asked"), said.append)
    assert trainer.engine == "compiled" and said[-1].startswith("engine: compiled in 0.2 s"), said
    seconds = compile_cache.cached_compile_seconds(engine.compile_key(model.config, tc, CPU, torch.float32))
    assert seconds is not None and 0.2 <= seconds < 5


def load_compiled_module(path: Path) -> None:
    """What inductor does with a compiled module it finds in its cache: import it, by the real loader, which refuses
    an empty file ("file too short"); its error comes out wrapped as inductor wraps it (InductorError)."""
    import importlib.machinery
    import importlib.util

    from torch._inductor.exc import InductorError

    loader = importlib.machinery.ExtensionFileLoader("main", str(path))
    try:
        loader.create_module(importlib.util.spec_from_loader("main", loader))
    except ImportError as e:
        raise InductorError(e, None) from e  # noqa: B904 - torch's own chain


def engine_trainer(tmp_path: Path, monkeypatch) -> tuple[SimpleNamespace, Path]:
    """A trainer of one small GPT for start_engine and warm_blocks, and its compile cache folder (in tmp_path)."""
    monkeypatch.setattr(compile_cache, "_USER_CACHE", str(tmp_path / "cache"))
    folder = compile_cache.cache_folder()
    monkeypatch.setattr(engine, "prepare_compile", lambda: folder)
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=8))
    tc = TrainConfig(batch_size=2)
    trainer = SimpleNamespace(model=model, tc=tc, device=CPU, dtype=torch.float32,
                              optimizer=make_optimizer(model, tc, CPU), splits={"train": torch.randint(0, 5, (64,))},
                              cfg=SimpleNamespace(model=model.config))
    return trainer, folder


@pytest.mark.parametrize("where", ["cache", "elsewhere", "again"])
def test_a_library_an_interrupted_compile_left_empty_in_the_cache_is_removed_and_compiled_again(
        tmp_path, monkeypatch, capsys, where):
    """A Ctrl-C while inductor linked the step left an empty main.so in the compile cache, which inductor then loaded
    at every compile: "engine: cannot compile here (InductorError: ImportError: .../main.so: file too short)", and
    every run trained eagerly, for good. The file is removed and the step compiled again; a file outside the cache is
    never removed, and a second failure trains eagerly, naming the file. Staged without compiling: the warm-up loads
    the file while it is there, by the real loader."""
    trainer, folder = engine_trainer(tmp_path, monkeypatch)
    library = (folder if where != "elsewhere" else tmp_path) / "ab" / "main.so"
    library.parent.mkdir(parents=True)
    library.touch()
    tries: list[bool] = []

    def warm_up(self, xs, ys):
        if where == "again":
            library.touch()  # built cut short again
        tries.append(library.exists())
        if library.exists():
            load_compiled_module(library)
        return 0.0

    monkeypatch.setattr(CompiledStep, "warm_up", warm_up)
    said: list[str] = []
    engine.start_engine(trainer, engine.EngineChoice("step", "asked"), said.append)
    err = capsys.readouterr().err
    failed = f"engine: cannot compile here (InductorError: ImportError: {library}: file too short); training without"
    if where == "elsewhere":
        assert tries == [True] and library.exists() and said[-1].startswith(failed) and "compile cache" not in err
        return
    assert (f"compile cache: '{library}' in it could not be loaded (file too short), left over from an interrupted "
            f"compile: it was removed, and is compiled again") in err
    if where == "cache":
        assert tries == [True, False] and not library.exists()
        assert trainer.engine == "compiled" and said[-1].startswith("engine: compiled in"), said
    else:
        assert tries == [True, True] and said[-1].startswith(failed), said
        assert getattr(trainer, "engine", None) != "compiled"


def test_the_blocks_compile_again_once_a_library_left_empty_in_the_cache_is_removed(tmp_path, monkeypatch, capsys):
    """The block-by-block path (torchrun, float16) met the same empty main.so and trained eagerly for good. Staged
    with a backend that loads the file while it is there, else runs the graph as traced."""
    trainer, folder = engine_trainer(tmp_path, monkeypatch)
    library = folder / "cd" / "main.so"
    library.parent.mkdir(parents=True)
    library.touch()

    def loading(gm, example_inputs):
        if library.exists():
            load_compiled_module(library)
        return gm.forward

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *args, **kwargs: compile_module(self, *args, **{**kwargs, "backend": loading}))
    engine.compile_blocks(trainer.model)
    choice = engine.warm_blocks(trainer, engine.EngineChoice("blocks", "asked"))
    assert choice.kind == "blocks" and "compiled in" in choice.reason, choice
    assert not library.exists() and "it was removed, and is compiled again" in capsys.readouterr().err
