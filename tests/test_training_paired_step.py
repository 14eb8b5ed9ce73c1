"""The compiled CPU step with its batch in two halves, one a thread (training/paired_step.py): where it applies, and
that a split run is the whole batch's run to float32's rounding, with the halves at once on two threads (the same
bits as one after the other), and resumes exactly."""

from __future__ import annotations

import math
import os
import select
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import needs_cpu_compile, tiny_overrides
from test_train import bitwise_equal, logged_losses
from test_training_engine import LOSS_TOLERANCE, WEIGHT_TOLERANCE
from training_runs import call, train_main, write_corpus

from model import GPT, GPTConfig, load_checkpoint
from training import TrainConfig, compiled_step, paired_step, step_file, step_update
from training.compiled_step import CompiledStep
from training.devices import DeviceError, resolve_device
from training.optim import make_optimizer

CPU = torch.device("cpu")


def test_a_bad_split_setting_is_one_line_for_a_person(monkeypatch):
    monkeypatch.setenv("TINYCHAR_SPLIT_STEP", " Auto ")
    assert paired_step.split_setting() == "auto"
    monkeypatch.setenv("TINYCHAR_SPLIT_STEP", "yes")
    with pytest.raises(ValueError, match="TINYCHAR_SPLIT_STEP must be one of auto, 0, 1, got 'yes'"):
        paired_step.split_setting()
    with pytest.raises(DeviceError, match="TINYCHAR_SPLIT_STEP must be one of"):
        resolve_device("cpu")


def test_auto_splits_small_steps_and_muons_on_two_threads_only(monkeypatch):
    monkeypatch.setattr(step_file, "AHEAD", True)
    monkeypatch.delenv("TINYCHAR_SPLIT_STEP", raising=False)
    threads = torch.get_num_threads()

    def parts(width: int | None = 32, dropout: bool = False, muon: bool = False, batch: int = 32, device: str = "cpu",
              dtype: torch.dtype = torch.float32, on: int = 2) -> int:
        torch.set_num_threads(on)
        try:
            return paired_step.parts_for(width, dropout, muon, batch, torch.device(device), dtype)
        finally:
            torch.set_num_threads(threads)

    assert parts() == 2 and parts(width=paired_step.SPLIT_MAX_WIDTH) == 2
    # the products of wider models share out; one thread or more than two (not measured)
    assert parts(width=128) == parts(width=None) == parts(on=1) == parts(on=4) == 1
    # Muon's update comes in two parts too, and pays beside the halves at wider models, up to those measured
    widest = paired_step.SPLIT_MAX_WIDTH_MUON
    assert parts(muon=True) == parts(width=128, muon=True) == parts(width=widest, muon=True) == 2
    assert parts(width=widest + 1, muon=True) == parts(muon=True, on=4) == parts(muon=True, dropout=True) == 1
    # never: dropout, an odd batch, another device or dtype, a torch without the step saved whole
    assert parts(dropout=True) == parts(batch=31) == parts(device="cuda") == parts(dtype=torch.bfloat16) == 1
    monkeypatch.setattr(step_file, "AHEAD", False)
    assert parts() == 1
    monkeypatch.setattr(step_file, "AHEAD", True)
    monkeypatch.setenv("TINYCHAR_SPLIT_STEP", "1")  # wherever it can
    assert parts(width=128, muon=True, on=1) == 2 and parts(dropout=True) == parts(batch=31) == 1
    monkeypatch.setenv("TINYCHAR_SPLIT_STEP", "0")
    assert parts() == 1


def steps_of(split: str, monkeypatch, dropout: float = 0.0, optimizer: str = "adamw") -> CompiledStep:
    monkeypatch.setenv("TINYCHAR_SPLIT_STEP", split)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=dropout))
    tc = replace(TrainConfig(), batch_size=6, grad_accum_steps=2, optimizer=optimizer, grad_clip=1.0)
    return CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.float32)


def test_a_model_with_dropout_keeps_the_whole_batch_and_muon_splits_where_asked(monkeypatch):
    assert steps_of("1", monkeypatch, dropout=0.1).setup.parts == 1  # each half would draw random numbers at once
    assert steps_of("1", monkeypatch, optimizer="muon").setup.parts == 2
    assert steps_of("0", monkeypatch).setup.parts == 1


def test_an_error_in_either_half_reaches_the_caller_and_the_worker_serves_again():
    def half(n: int) -> int:
        if n < 0:
            raise ValueError(f"half {n}")
        return n * 2

    assert paired_step.both(half, (1,), (2,)) == (2, 4)
    with pytest.raises(ValueError, match="half -2"):
        paired_step.both(half, (1,), (-2,))
    with pytest.raises(ValueError, match="half -1"):
        paired_step.both(half, (-1,), (-2,))  # the caller's own, after the worker's half ended
    assert paired_step.both(half, (3,), (4,)) == (6, 8)


def test_muons_update_in_two_parts_is_the_whole_update_each_part_writing_only_its_own_values(monkeypatch):
    """The two parts of the split step's update with Muon (CompiledStep.part_args), run as plain PyTorch: together
    they make paired_update's update to float32's rounding; each writes only its own slices of the buffers, the
    first AdamW's state and its matrices, the second the other matrices; a gradient that is not finite leaves all."""
    step = steps_of("1", monkeypatch, optimizer="muon")  # one layer: AdamW's embeddings, norms and head; 4 matrices
    assert step.layout.matrices == 4 and step.parts == 2
    gen = torch.Generator().manual_seed(1)
    for t in (step.exp_avg, step.momentum):
        t.copy_(torch.randn(t.shape, generator=gen) * 1e-2)
    step.exp_avg_sq.copy_(torch.rand(step.exp_avg_sq.shape, generator=gen) * 1e-4)
    step.steps.fill_(3.0)
    halves = (torch.randn(step.flat.shape, generator=gen), torch.tensor(1.25), torch.randn(step.flat.shape,
              generator=gen), torch.tensor(0.75))
    setup = step.constants()
    step.lr.fill_(1e-2)  # the learning rate's tensor, which each call fills (part_args passes it on)
    before = [t.clone() for t in step.buffers()]

    def updated(halves: tuple[torch.Tensor, ...], parts: bool) -> tuple[list[torch.Tensor], list[tuple]]:
        buffers = [t.clone() for t in before]
        if not parts:
            return buffers, [step_update.paired_update(*buffers, step.decay, step.owner, *halves, step.lr,
                                                       step.layout, setup)]
        first, second = step.part_args(tuple(buffers), halves, setup)
        assert first[-3] == 0 and second[-3] == first[0].numel()  # where each part's values begin in flat
        out = [step_update.paired_part(*first)]
        cut, in_momentum = first[0].numel(), first[4].numel()
        flat, exp_avg, exp_avg_sq, steps, momentum = buffers
        assert torch.equal(flat[cut:], before[0][cut:]) and torch.equal(momentum[in_momentum:], before[4][in_momentum:])
        assert not torch.equal(flat[:cut], before[0][:cut]) and not torch.equal(momentum[:in_momentum],
                                                                                 before[4][:in_momentum])
        assert torch.equal(steps, before[3] + 1) and not torch.equal(exp_avg, before[1])  # AdamW: the first part's
        kept = [t.clone() for t in buffers]
        out.append(step_update.paired_part(*second))
        assert all(torch.equal(a, b) for a, b in zip(buffers[1:4], kept[1:4], strict=True))
        assert torch.equal(flat[:cut], kept[0][:cut]) and torch.equal(momentum[:in_momentum], kept[4][:in_momentum])
        assert not torch.equal(flat[cut:], before[0][cut:])
        return buffers, out

    with torch.no_grad():
        whole, (expected,) = updated(halves, parts=False)
        parted, results = updated(halves, parts=True)
        assert all(torch.equal(r[0], expected[0]) and torch.equal(r[1], expected[1]) for r in results)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(parted, whole, strict=True))
        assert max((a - b).abs().max().item() for a, b in zip(parted, before, strict=True)) > 1e-4  # it moved them
        nan = (halves[0].clone().index_fill_(0, torch.tensor([len(halves[0]) - 1]), math.nan), *halves[1:])
        buffers = tuple(t.clone() for t in before)
        for part in step.part_args(buffers, nan, setup):
            assert math.isnan(step_update.paired_part(*part)[1].item())
        assert all(torch.equal(a, b) for a, b in zip(buffers, before, strict=True))


@needs_cpu_compile
@pytest.mark.slow
def test_a_split_compiled_run_is_the_whole_batchs_run_and_resumes_exactly(tmp_path: Path, capsys, monkeypatch):
    """train.py compiled with the batch in halves and Muon's update in two parts (two micro-batches a step, Muon and
    AdamW, clipping): each step ran the halves at once, then the parts, on the worker and the caller's thread, with
    the same bits as one after the other; its losses and weights are the eager whole batch's to float32's rounding;
    stopped at step 10 and resumed, it ends bit for bit where the straight run did, weights and optimizer state."""
    corpus = write_corpus(tmp_path)
    keys = {"model.n_layer": 1, "train.lr_decay_iters": 20, "train.log_interval": 1, "train.grad_accum_steps": 2,
            "train.sample_chars": 0, "train.tensorboard": "false", "train.compile": "true",
            "train.optimizer": "muon", "model.dropout": 0.0}

    logs = {}

    def run(out: str, *extra: str, **more: object) -> dict[int, str]:
        code, stdout, err = call(train_main, [*tiny_overrides(corpus, tmp_path / out, **{**keys, **more}), *extra],
                                 capsys)
        assert code == 0, err
        logs[out] = stdout
        return logged_losses(stdout)

    eager = run("eager", **{"train.compile": "false"})
    monkeypatch.setenv("TINYCHAR_SPLIT_STEP", "1")
    calls = []
    both = paired_step.both

    def spied(fn, first, second, other=None):
        calls.append((threading.get_ident(), torch.get_num_threads(), other is not None))
        return both(fn, first, second, other)

    monkeypatch.setattr(paired_step, "both", spied)
    straight = run("straight")
    assert "; each batch in two halves, one a core, and Muon's update in two parts" in logs["straight"]
    assert "halves" not in logs["eager"]
    halves, parts = ([c for c in calls if c[2] == parted] for parted in (False, True))
    assert len(halves) == len(parts) >= 20 and paired_step._WORKER is not None  # every step (and the warm-up) split
    assert {c[:2] for c in calls} == {(threading.get_ident(), 1)} and torch.get_num_threads() == 1  # the tests' one
    assert max(abs(float(eager[s]) - float(straight[s])) for s in eager) < LOSS_TOLERANCE
    expected = load_checkpoint(tmp_path / "straight" / "ckpt.pt")
    eager_w = load_checkpoint(tmp_path / "eager" / "ckpt.pt")["model"]
    assert max((eager_w[k] - expected["model"][k]).abs().max().item() for k in eager_w) < WEIGHT_TOLERANCE
    assert not bitwise_equal(eager_w, expected["model"])  # another order of additions

    run("resumed", **{"train.max_iters": 10})
    resumed = run("resumed", "--resume")
    assert {s: resumed[s] for s in range(11, 21)} == {s: straight[s] for s in range(11, 21)}
    final = load_checkpoint(tmp_path / "resumed" / "ckpt.pt")
    assert bitwise_equal(final["model"], expected["model"])
    assert all(bitwise_equal(final["optimizer"]["state"][i], state)
               for i, state in expected["optimizer"]["state"].items())

    monkeypatch.setattr(paired_step, "both", lambda fn, first, second, other=None: (fn(*first), (other or fn)(*second)))
    assert run("in-turn") == straight  # the halves, and the parts, one after the other
    assert bitwise_equal(load_checkpoint(tmp_path / "in-turn" / "ckpt.pt")["model"], expected["model"])


def test_a_forked_child_starts_a_worker_of_its_own():
    """Only the forking thread lives on in a child (tests/zygote.py forks test processes, and a run may): a worker
    kept from the parent would never answer."""
    assert paired_step.both(abs, (-1,), (-2,)) == (1, 2)  # the parent's worker, started
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own worker, or it waits forever (the parent's timeout below ends it)
        try:
            os.write(write, repr(paired_step.both(abs, (-3,), (-4,))).encode())
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 30)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert ready and os.read(read, 100) == b"(3, 4)"
    os.close(read)


def test_halves_compiled_with_guards_run_one_after_the_other_on_the_callers_thread(monkeypatch):
    """Where the step cannot be saved whole (a failure of that API), torch.compile's own code with dynamo's guards
    takes the halves, which are not for two threads at once: both on this thread, in turn, then the update."""
    calls = []

    def failing(fn: object, args: tuple, device: torch.device) -> tuple[object, str]:
        raise RuntimeError("aot_compile is not supported here")

    def gradients(model, flat, xs, ys, layout, setup):
        calls.append(("half", threading.get_ident(), xs.shape[1], torch.get_num_threads()))
        return torch.zeros_like(flat), torch.zeros(())

    def update(*args):
        calls.append(("update", threading.get_ident()))
        return torch.zeros(()), torch.zeros(())

    monkeypatch.setattr(step_file, "AHEAD", True)
    monkeypatch.setattr(step_file, "step_function", failing)
    monkeypatch.setattr(compiled_step, "_COMPILED", {compiled_step._gradients: gradients,
                                                     step_update.paired_update: update})
    monkeypatch.setattr(paired_step, "both", lambda *a: pytest.fail("guarded code on two threads"))
    step = steps_of("1", monkeypatch)
    assert step.parts == 2
    step(torch.zeros(2, 6, 8, dtype=torch.long), torch.zeros(2, 6, 8, dtype=torch.long), 1e-3)
    me = threading.get_ident()
    assert calls == [("half", me, 3, 1), ("half", me, 3, 1), ("update", me)] and step.source == "compiled with guards"
