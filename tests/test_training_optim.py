"""training/optim.py: the learning-rate schedule, a linear warmup to the peak, then a cosine decay to min_lr at
lr_decay_iters (max_iters by default), or a constant rate when decay is off; and the optimizers, AdamW or Muon for
the blocks' matrices (train.optimizer), eager and as the compiled step runs them."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, tiny_overrides
from torch import nn

from model import GPT, GPTConfig
from training import compiled_step, optim
from training.compiled_step import CompiledStep
from training.config import TrainConfig
from training.optim import Muon, lr_at, make_optimizer, orthogonalize, orthogonalize_each

OPTIMIZERS = ("adamw", "muon")  # train.optimizer's choices


def schedule(**kw) -> TrainConfig:
    base = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "max_iters": 100}
    return TrainConfig(**{**base, **kw})


def test_warmup_rises_to_the_learning_rate():
    cfg = schedule()
    rates = [lr_at(s, cfg) for s in range(cfg.warmup_iters + 1)]
    assert 0 < rates[0] < cfg.learning_rate
    assert all(a < b for a, b in itertools.pairwise(rates))
    assert rates[-1] == cfg.learning_rate  # warmup ends exactly at the peak


def test_cosine_reaches_min_lr_at_max_iters_by_default_and_stays():
    cfg = schedule()
    mid = (cfg.warmup_iters + cfg.max_iters) // 2
    assert lr_at(mid, cfg) == pytest.approx((cfg.learning_rate + cfg.min_lr) / 2)
    assert lr_at(cfg.max_iters - 1, cfg) > cfg.min_lr
    assert lr_at(cfg.max_iters, cfg) == pytest.approx(cfg.min_lr)
    assert all(lr_at(s, cfg) == cfg.min_lr for s in range(cfg.max_iters, cfg.max_iters + 50))


def test_lr_decay_iters_moves_the_end_of_the_decay():
    cfg = schedule(lr_decay_iters=50)
    assert lr_at(49, cfg) > cfg.min_lr
    assert lr_at(50, cfg) == pytest.approx(cfg.min_lr)
    assert lr_at(80, cfg) == cfg.min_lr
    assert lr_at(30, cfg) == pytest.approx((cfg.learning_rate + cfg.min_lr) / 2)
    assert lr_at(30, cfg) < lr_at(30, replace(cfg, lr_decay_iters=None))


def test_the_rate_never_rises_after_warmup():
    cfg = schedule(max_iters=300, warmup_iters=17)
    rates = [lr_at(s, cfg) for s in range(cfg.warmup_iters, 400)]
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert rates[0] == cfg.learning_rate and rates[-1] == cfg.min_lr


def test_no_warmup_starts_at_the_peak():
    cfg = schedule(warmup_iters=0)
    assert lr_at(0, cfg) == cfg.learning_rate


def test_a_constant_rate_when_decay_is_off():
    cfg = schedule(decay_lr=False)
    assert {lr_at(s, cfg) for s in (0, 5, 10, 50, 99, 100, 1000)} == {cfg.learning_rate}


# --------------------------------------------------------------------------------------- Muon (train.optimizer)


def small_gpt(**model: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16, **model))


@pytest.mark.parametrize("shape", [(48, 16), (16, 64), (32, 32)])
def test_orthogonalize_sets_every_singular_value_near_one_and_keeps_the_singular_vectors(shape):
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(shape, generator=gen) * torch.logspace(0, -1, shape[1])  # singular values spread over 100x
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    o = orthogonalize(m)
    assert o.shape == m.shape
    sv = torch.linalg.svdvals(o)
    # Five steps of the polynomial bring each singular value into about [0.68, 1.13] from as low as 1e-2 of the
    # largest (the plain SVD answer, U V^T, would be exactly 1).
    assert sv.max() < 1.2 and sv.min() > 0.6
    # In m's singular basis the result is diagonal with positive entries: the same directions, rescaled.
    core = u.mT @ o @ vh.mT
    diagonal = torch.diagonal(core)
    assert diagonal.min() > 0.6
    assert (core - torch.diag(diagonal)).abs().max() < 1e-3
    assert torch.allclose(orthogonalize(m.mT), o.mT, atol=1e-6)  # a tall matrix is its transpose's answer


def test_a_bfloat16_run_orthogonalises_in_bfloat16_close_to_float32():
    m = torch.randn(64, 192, generator=torch.Generator().manual_seed(4))
    exact, rounded = orthogonalize(m), orthogonalize(m, torch.bfloat16)
    assert rounded.dtype == torch.float32 and not torch.equal(exact, rounded)
    assert torch.nn.functional.cosine_similarity(exact.flatten(), rounded.flatten(), dim=0) > 0.999
    model = small_gpt()
    assert make_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"),
                          torch.bfloat16).orthogonal_dtype == torch.bfloat16
    assert make_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu")).orthogonal_dtype is None


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def test_orthogonalize_each_answers_as_one_by_one_through_the_gram_matrices_in_float32():
    gen = torch.Generator().manual_seed(0)
    shapes = [(48, 16), (16, 16), (64, 16), (16, 64)] * 2  # a 2-layer model's q/k/v, projection, MLP in and out
    matrices = [torch.randn(s, generator=gen) for s in shapes]
    # The Gram form is orthogonalize's iteration rearranged: in float64 the two agree to rounding, each matrix
    # alone (the tall ones transposed) and all of them together
    exact = [orthogonalize(m.double()) for m in matrices]
    for m, e in zip(matrices, exact, strict=True):
        x = (m.mT if m.size(0) > m.size(1) else m).double().unsqueeze(0)
        (alone,) = optim.gram_newton_schulz([x / x.norm()])
        assert relative_error(alone[0].mT if m.size(0) > m.size(1) else alone[0], e) < 1e-12
    assert all(relative_error(t, e) < 1e-12
               for t, e in zip(orthogonalize_each([m.double() for m in matrices]), exact, strict=True))
    # In float32 its rounding compounds through the Gram's steps: up to 2.4e-5 of these updates (the square ones),
    # where x's own steps keep 1e-6 (and torch.optim.Muon's bfloat16 about 3e-2)
    together = orthogonalize_each(matrices)
    assert [t.shape for t in together] == [m.shape for m in matrices]
    assert all(t.dtype == torch.float32 for t in together)
    assert max(relative_error(t, e) for t, e in zip(together, exact, strict=True)) < 1e-4
    # In bfloat16 it compounds far more (3.1 times the update's own size for one of these): bfloat16 keeps x's
    # steps, a batch per shape, within 0.04 here
    rounded = orthogonalize_each(matrices, torch.bfloat16)
    assert all(torch.allclose(t, orthogonalize(m, torch.bfloat16), atol=1e-2)
               for t, m in zip(rounded, matrices, strict=True))
    assert max(relative_error(t, e) for t, e in zip(rounded, exact, strict=True)) < 0.1


def test_muon_takes_the_blocks_matrices_and_leaves_embeddings_head_biases_and_norms_to_adamw():
    model = small_gpt()
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    assert isinstance(optimizer, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    assert sorted(muon) == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    adamw = [names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]]
    assert "transformer.wte.weight" in adamw and "transformer.wpe.weight" in adamw  # the tied head is wte
    assert len(adamw) + len(muon) == len(list(model.parameters()))
    assert isinstance(make_optimizer(model, TrainConfig(), torch.device("cpu")), torch.optim.AdamW)
    with pytest.raises(ValueError, match="train.optimizer must be one of adamw, muon; got 'sgd'"):
        TrainConfig(optimizer="sgd")


def test_muon_steps_a_matrix_as_torchs_muon_and_the_rest_exactly_as_adamw():
    """Against torch.optim.Muon with the same rule for the learning rate (match_rms_adamw: 0.2 sqrt(max(A, B))),
    which orthogonalises in bfloat16 where ours is float32: the same steps to within 3% of their size (1% measured).
    The AdamW half is torch's own update, to the bit."""
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(48, 16, generator=gen) * 0.02
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    mine = Muon([{"params": [ours], "weight_decay": 0.1, "muon": True}], lr=1e-2, betas=(0.9, 0.99))
    torchs = torch.optim.Muon([theirs], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        g = torch.randn(48, 16, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        mine.step()
        torchs.step()
    moved = (ours - start).abs().max().item()
    assert moved > 1e-2  # three steps of about lr x 0.2 sqrt(48) / sqrt(16) each
    assert (ours - theirs).abs().max().item() < 0.03 * moved
    assert torch.allclose(mine.state[ours]["momentum_buffer"], torchs.state[theirs]["momentum_buffer"])

    trained = []
    for build in ("adamw", "muon"):
        model = small_gpt()
        optimizer = make_optimizer(model, TrainConfig(optimizer=build), torch.device("cpu"))
        if build == "muon":  # every parameter in AdamW's groups: then Muon must be torch's AdamW exactly
            optimizer.param_groups[0]["params"] += optimizer.param_groups[2]["params"]
            optimizer.param_groups[2]["params"] = []
        batches = torch.Generator().manual_seed(3)
        for _ in range(3):
            x = torch.randint(0, 20, (4, 8), generator=batches)
            model(x, x.roll(1, -1))[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        trained.append(model.state_dict())
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_weight_decay_shrinks_matrices_and_embeddings_and_leaves_biases_and_norms_alone(optimizer):
    """train.weight_decay is for matrices only: a step whose gradients are all zero moves nothing but the decay, which
    takes each matrix and embedding to (1 - lr x weight_decay) of itself and leaves the biases and the layer norms'
    weights as they were. (Every other test of the optimizers compares two paths that share its groups: one group
    decaying everything passed them all.)"""
    model = small_gpt()
    with torch.no_grad():  # no zeros (the biases start at 0, which decays to 0) and no ones (the norms' weights)
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())) + 0.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = TrainConfig(optimizer=optimizer, learning_rate=0.5, weight_decay=0.1)
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decayed = {name for name, p in model.named_parameters() if p.dim() >= 2}
    assert "transformer.wte.weight" in decayed and "transformer.h.0.attn.c_attn.weight" in decayed
    for name, p in model.named_parameters():
        if name in decayed:
            torch.testing.assert_close(p.detach(), before[name] * (1 - 0.5 * 0.1), msg=name)
        else:  # biases, and the layer norms' weights and biases
            assert torch.equal(p.detach(), before[name]), name
    assert len(decayed) < len(before)  # the biases and norms were there to leave alone


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_compiled_steps_update_is_the_optimizers_run_as_plain_pytorch(optimizer):
    """training.compiled_step's whole step (clipping and the update on flat buffers), run here without compiling,
    against the eager step: clip_grad_norm_ and the optimizer, 5 steps. Only the order of float32 additions differs."""
    cfg = TrainConfig(optimizer=optimizer, learning_rate=1e-2, grad_clip=0.5)
    batches = [torch.randint(0, 20, (1, 4, 9), generator=torch.Generator().manual_seed(s)) for s in range(5)]
    eager = small_gpt()
    eager_opt = make_optimizer(eager, cfg, torch.device("cpu"))
    for b in batches:
        eager(b[0, :, :8], b[0, :, 1:])[1].backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), cfg.grad_clip)
        eager_opt.step()
        eager_opt.zero_grad()
    flat = small_gpt()
    flat_opt = make_optimizer(flat, cfg, torch.device("cpu"))
    step = CompiledStep(flat, flat_opt, cfg, torch.device("cpu"), torch.float32)
    assert step.layout.matrices == (8 if optimizer == "muon" else 0)
    for b in batches:
        with torch.no_grad():
            compiled_step._whole_step(flat, *step.buffers(), step.decay, step.owner, b[:, :, :8], b[:, :, 1:],
                               torch.tensor(cfg.learning_rate, dtype=torch.float64), step.layout, step.setup)
    # Each step moves a weight by up to about lr (AdamW) or lr x 0.2 sqrt(64) / 4 (Muon): 1e-2; rounding, 1e-5.
    assert max((eager.state_dict()[k] - v).abs().max().item() for k, v in flat.state_dict().items()) < 1e-4
    assert max((eager.state_dict()[k] - v).abs().max().item() for k, v in small_gpt().state_dict().items()) > 1e-2
    # The optimizer's own state, seen through the flat buffers' views, is what the eager optimizer holds.
    ours, theirs = flat_opt.state_dict()["state"], eager_opt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[i][k].float(), v.float(), atol=1e-5) for i in theirs for k, v in theirs[i].items())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("compiler", [False, True])
def test_adamw_steps_saves_and_loads_as_torchs_adamw_with_the_compiler_loaded_or_not(fused, compiler, monkeypatch):
    """training.optim.AdamW skips torch's wrappers that import the compiler (while none is loaded): the same updates to
    the bit, the same state, and checkpoints that either class loads."""
    monkeypatch.setattr(optim, "compiler_loaded", lambda: compiler)
    weights = [torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), torch.randn(5)]
    ours_params = [nn.Parameter(w.clone()) for w in weights]
    torch_params = [nn.Parameter(w.clone()) for w in weights]

    def groups(params: list[nn.Parameter]) -> list[dict]:
        return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]

    ours = optim.AdamW(groups(ours_params), lr=1e-2, betas=(0.9, 0.95), fused=fused)
    theirs = torch.optim.AdamW(groups(torch_params), lr=1e-2, betas=(0.9, 0.95), fused=fused)
    assert isinstance(ours, torch.optim.AdamW)
    draws = torch.Generator().manual_seed(2)
    for step in range(3):
        grads = [torch.randn(w.shape, generator=draws) for w in weights]
        for optimizer, params in ((ours, ours_params), (theirs, torch_params)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            optimizer.step()
            optimizer.zero_grad()
            assert all(p.grad is None for p in params)
        assert all(torch.equal(a, b) for a, b in zip(ours_params, torch_params, strict=True))
    saved, expected = ours.state_dict(), theirs.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert all(torch.equal(saved["state"][i][k], expected["state"][i][k]) for i in expected["state"]
               for k in expected["state"][i])
    # each class resumes from the other's state
    again = optim.AdamW(groups([nn.Parameter(p.detach().clone()) for p in torch_params]), lr=1.0, fused=fused)
    again.load_state_dict(expected)
    back = torch.optim.AdamW(groups([nn.Parameter(p.detach().clone()) for p in ours_params]), lr=1.0, fused=fused)
    back.load_state_dict(saved)
    assert again.state_dict()["param_groups"] == back.state_dict()["param_groups"] == expected["param_groups"]


def test_an_eager_run_and_its_resume_never_import_the_compiler(tmp_path):
    """Importing torch's compiler (torch._dynamo) took 1.65 s of every train.py's launch here, compiling or not; now
    only a run that compiles imports it. In a process of its own, where nothing else has. Under train.compile=auto,
    which reads the compile cache's marker for the run's key (and 4 steps never compile)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    runs = [[*tiny_overrides(corpus, tmp_path / f"out-{name}", **{"train.optimizer": name, "train.max_iters": 4,
                                                                  "train.eval_interval": 2, "train.compile": "auto"})]
            for name in OPTIMIZERS]
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import json, train; runs = json.loads(sys.argv[2]); "
             "codes = [train.main(a, progress=False) for r in runs "
             "for a in (r, [*r, 'train.max_iters=6', '--resume'])]; "
             "print(codes, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT), json.dumps(runs)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "[0, 0, 0, 0] False", out
    assert (tmp_path / "out-adamw" / "ckpt.pt").exists() and (tmp_path / "out-muon" / "ckpt.pt").exists()
