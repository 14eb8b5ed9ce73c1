"""The compiled training step (training.compiled_step): traced and run under deterministic kernels, the guards dynamo
keeps before each call and the settings that stand in for the others, and AdamW's update with shared or per-parameter
step counts. That a step whose loss is not finite leaves everything untouched is tested in test_training_engine.py,
after its compiled runs, whose compiled code it reuses."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import SMALL_TEXT, needs_cpu_compile, tiny_overrides
from test_training_engine import ENGINE_KEYS, step_of_the_runs
from torch import nn
from training_runs import write_corpus

from data import CharTokenizer
from model import GPT, GPTConfig
from training import TrainConfig, compiled_step, load_config, step_file
from training.compile_cache import compile_options
from training.compiled_step import CompiledStep
from training.optim import make_optimizer

CPU = torch.device("cpu")


@needs_cpu_compile
def test_deterministic_kernels_make_compiled_gradients_reproducible():
    """Without them inductor's threads add the token embedding's gradient into its rows with atomic adds, in the
    order they happen to reach them (measured here: 4,096 tokens into 4 rows, 10 repeats, none equal to the first).
    Under them the same input gives the same gradient to the bit, every time."""
    def embedding_grad(w: torch.Tensor, idx: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda w: (torch.nn.functional.embedding(idx, w) * up).sum())(w)

    gen = torch.Generator().manual_seed(0)
    w, idx = torch.randn(4, 64, generator=gen), torch.randint(0, 4, (4096,), generator=gen)
    up = torch.randn(idx.numel(), 64, generator=gen)
    compiled = torch.compile(embedding_grad, fullgraph=True, dynamic=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tests' one thread adds in one order: nothing to race
    try:
        with compiled_step.deterministic_kernels(CPU):
            grads = [compiled(w, idx, up) for _ in range(10)]
    finally:
        torch.set_num_threads(threads)
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before
    assert torch.allclose(grads[0], embedding_grad(w, idx, up), atol=1e-3)
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


def test_the_compiled_step_is_traced_and_run_under_deterministic_kernels(tmp_path, monkeypatch):
    seen = []

    def settings(when: str) -> tuple[str, bool, bool]:
        return when, torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory

    def compiled(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(settings("run"))
        return torch.zeros(()), torch.zeros(())

    def step_function(fn: object, args: tuple, device: torch.device) -> tuple[object, str]:
        seen.append(settings("traced"))
        return compiled, "compiled"

    monkeypatch.setattr(step_file, "step_function", step_function)  # the step compiled ahead of time
    # torch.compile's own, where that cannot be
    monkeypatch.setattr(compiled_step, "_COMPILED", {compiled_step._whole_step: compiled})
    for ahead in (True, False):
        monkeypatch.setattr(step_file, "AHEAD", ahead)
        seen.clear()
        (tmp_path / str(ahead)).mkdir()
        _, _, step, xs = step_of_the_runs(tmp_path / str(ahead))
        step.warm_up(xs, xs.clone())
        step(xs, xs.clone(), 1e-3)
        traced = [("traced", True, False)] if ahead else []
        assert seen == [*traced, ("run", True, False), ("run", True, False)]
        assert not torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory


def test_the_compiled_step_keeps_dynamos_guards_on_its_arguments_and_torchs_state_not_on_the_model():
    def entry(guard_type: str, source: str, value: object = None) -> SimpleNamespace:
        return SimpleNamespace(guard_type=guard_type, value=value, orig_guard=SimpleNamespace(name=source))

    kept = [entry("TENSOR_MATCH", "L['flat']", torch.zeros(2)),
            entry("TENSOR_MATCH", "L['model']._modules['attn']._buffers['mask']", torch.zeros(2)),
            entry("CONSTANT_MATCH", "L['layout'].names[0]", "wte.weight"), entry("SEQUENCE_LENGTH", "L['layout']"),
            entry("CONSTANT_MATCH", "L['setup'].module", "ab12"), entry("CONSTANT_MATCH", "L['setup'].training"),
            entry("DUPLICATE_INPUT", "L['ys']"), entry("GLOBAL_STATE", ""), entry("DETERMINISTIC_ALGORITHMS", ""),
            entry("GRAD_MODE", ""), entry("DEFAULT_DEVICE", "")]
    dropped = [entry("TENSOR_MATCH", "L['model']._modules['wte']._parameters['weight']", nn.Parameter(torch.zeros(2))),
               entry("CONSTANT_MATCH", "L['model']._modules['drop'].p", 0.0),
               entry("EMPTY_NN_MODULE_HOOKS_DICT", "L['model']._forward_hooks"),
               entry("CLOSURE_MATCH", "G['torch'].func.functional_call"), entry("ID_MATCH", "G['torch']")]
    assert compiled_step.step_guards(kept + dropped) == [True] * len(kept) + [False] * len(dropped)


def test_the_guard_filter_goes_to_torch_compile_only_where_torch_takes_it(monkeypatch):
    """torch 2.6 and 2.7 (requirements.txt allows them) refuse an unknown option: the step would never compile."""
    monkeypatch.setattr(compiled_step, "GUARD_FILTER", False)
    assert compiled_step.step_options(CPU) == compile_options(CPU)
    monkeypatch.setattr(compiled_step, "GUARD_FILTER", True)
    assert compiled_step.step_options(CPU) == {**compile_options(CPU), "guard_filter_fn": compiled_step.step_guards}


def test_module_settings_tell_apart_what_the_traced_step_reads_of_a_model():
    def settings(**kw: object) -> str:
        return compiled_step.module_settings(GPT(GPTConfig(vocab_size=5, n_layer=1, n_embd=8, n_head=2, **kw)))

    plain = settings()
    assert plain == settings()  # another model of the same settings (its weights are not settings)
    assert len({plain, settings(dropout=0.1), settings(attention="fused"), settings(score="additive"),
                settings(bias=False), settings(block_size=16)}) == 6
    model = GPT(GPTConfig(vocab_size=5, n_layer=1, n_embd=8, n_head=2))
    model.eval()  # the mode goes to the step apart (Setup.training)
    assert compiled_step.module_settings(model) == plain
    model.transformer.h[0].register_forward_hook(lambda *args: None)
    assert compiled_step.module_settings(model) != plain
    onednn = GPT(GPTConfig(vocab_size=5, n_layer=1, n_embd=8, n_head=2))
    onednn.transformer.h[0].mlp.c_fc.onednn_min_rows = 32  # model/linear.py's choice, made when a layer is built
    assert compiled_step.module_settings(onednn) != plain


class DropoutBigram(nn.Module):
    """The smallest model CompiledStep trains (quick to compile): an embedding, dropout, a tied head."""

    def __init__(self, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(5, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.drop(self.wte(x)) @ self.wte.weight.T
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@needs_cpu_compile
def test_a_compiled_step_never_runs_code_traced_for_a_model_of_other_settings_or_mode():
    """Dynamo does not check the model's attributes before each call (compiled_step.step_guards), so the setup carries
    them: a model that differs only in its dropout, or in its mode, gets code of its own. Trained with code traced
    for another, the dropout model would give the plain one's loss, and in eval mode a dropped-out one."""
    tc = replace(TrainConfig(), grad_accum_steps=1)
    xs = torch.randint(0, 5, (1, 4, 6), generator=torch.Generator().manual_seed(0))

    def first_loss(p: float, training: bool = True) -> float:
        model = DropoutBigram(p).train(training)
        step = CompiledStep(model, make_optimizer(model, tc, CPU), tc, CPU, torch.float32)
        return step(xs, xs.roll(1, -1), 1e-3)[0].item()

    plain = first_loss(0.0)
    assert first_loss(0.5) != plain
    assert first_loss(0.5, training=False) == pytest.approx(plain, abs=1e-6)


def test_the_update_reads_the_step_count_once_when_every_parameter_shares_it(tmp_path):
    """The compiled step's AdamW takes its bias corrections as two numbers when every parameter has taken as many
    steps, and per parameter otherwise (a checkpoint whose parameters disagree): run here without compiling, the
    two forms give the same weights and moments to the bit, and the per-parameter form follows each count."""
    cfg = load_config(None, tiny_overrides(write_corpus(tmp_path), tmp_path / "out", **ENGINE_KEYS))
    vocab = CharTokenizer.from_text(SMALL_TEXT).vocab_size
    xs = torch.randint(0, vocab, (2, cfg.train.batch_size, 8), generator=torch.Generator().manual_seed(0))

    def one_step(counts: list[float] | None, same: bool | None = None) -> CompiledStep:
        torch.manual_seed(0)
        model = GPT(replace(cfg.model, vocab_size=vocab))
        optimizer = make_optimizer(model, cfg.train, CPU)
        step = CompiledStep(model, optimizer, cfg.train, CPU, torch.float32)
        if counts is not None:
            step.steps.copy_(torch.tensor(counts))
            step = CompiledStep(model, optimizer, cfg.train, CPU, torch.float32)  # as a resume would build it
        if same is not None:
            step.setup = step.setup._replace(same_steps=same)
        lr = compiled_step.lr_argument(1e-2, CPU)
        with torch.no_grad():  # what CompiledStep.__call__ compiles, run as plain PyTorch
            compiled_step._whole_step(model, *step.buffers(), step.decay, step.owner, xs, xs.roll(1, -1), lr,
                                      step.layout, step.setup)
        return step

    shared = one_step(None)
    assert shared.setup.same_steps
    gathered = one_step(None, same=False)
    assert all(torch.equal(a, b) for a, b in zip(shared.buffers(), gathered.buffers(), strict=True))
    assert torch.equal(shared.steps, torch.ones_like(shared.steps))

    counts = [float(i % 3) for i in range(len(shared.steps))]  # 0, 1, 2, 0, ...: bias corrections of steps 1, 2, 3
    uneven = one_step(counts)
    assert not uneven.setup.same_steps
    assert uneven.steps.tolist() == [c + 1 for c in counts]
    # From the same weights and empty moments: a parameter at its first step moves exactly as in the shared run; one
    # at its second or third takes that step's bias corrections (about 0.74 and 0.62 of the first step's size).
    parts = [(a - b).abs() for a, b in zip(uneven.flat.split(uneven.layout.sizes),
                                           shared.flat.split(shared.layout.sizes), strict=True)]
    assert all(parts[i].max() == 0 for i, c in enumerate(counts) if c == 0)
    assert all(parts[i].max() > 1e-4 for i, c in enumerate(counts) if c > 0)


def test_the_warm_up_keeps_the_random_streams_of_the_steps_device(tmp_path, monkeypatch):
    """The warm-up's dropout must not move them: on CUDA the compiled step's dropout draws its seeds from the GPU's
    generator (devices.random_kept, whose own test fakes one), on a CPU from torch's."""
    kept = []
    real = compiled_step.random_kept

    def recording(device: torch.device):
        kept.append(device)
        return real(device)

    def compiled(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        torch.rand(3)  # a draw, as dropout's
        return torch.zeros(()), torch.zeros(())

    monkeypatch.setattr(step_file, "AHEAD", False)
    monkeypatch.setattr(compiled_step, "_COMPILED", {compiled_step._whole_step: compiled})
    monkeypatch.setattr(compiled_step, "random_kept", recording)
    _, _, step, xs = step_of_the_runs(tmp_path)
    before = torch.get_rng_state()
    step.warm_up(xs, xs.clone())
    assert kept == [CPU]
    assert torch.equal(torch.get_rng_state(), before)
    step.device = torch.device("meta")  # the streams of the step's own device, whichever (the fake step runs on any)
    step.warm_up(xs, xs.clone())
    assert kept == [CPU, torch.device("meta")]
