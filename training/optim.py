"""The optimizer and its learning-rate schedule: warmup then cosine decay, and either AdamW (decay on matrices only)
or Muon for the blocks' weight matrices with AdamW for the rest (train.optimizer)."""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from .config import TrainConfig
from .errors import UsageError

# Muon's constants. The Newton-Schulz polynomial a x + b x^3 + c x^5 is the one Keller Jordan tuned for Muon (2024):
# five steps take every singular value of a normalised matrix into roughly [0.7, 1.2], quickly rather than exactly.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_STEPS = 5
MUON_MOMENTUM = 0.95
FLOAT32_MAX = torch.finfo(torch.float32).max


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, cosine decay, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else cfg.max_iters
    if step >= decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def schedule_note(saved: dict, train: TrainConfig, step: int) -> str | None:
    """The line for a resume whose learning rate from step on changes (saved: the checkpoint's train section), or None.
    train.lr_decay_iters follows train.max_iters unless set, so a longer run stretches the cosine: resuming a
    finished 20-step tiny run with max_iters=40 took the rate from 1.07e-03 to 5.50e-03 in two steps, unannounced."""
    kept = {k: saved[k] for k in ("max_iters", "lr_decay_iters", "min_lr") if k in saved}
    try:
        before = replace(train, **kept)
    except (TypeError, ValueError):  # values no run saves: the resume's own checks speak of the config
        return None
    # Where the two schedules part: now, or (within the warmup, which they share) at the decay's first step
    for at in (step, max(step, train.warmup_iters + 1)):
        old, new = lr_at(at, before), lr_at(at, train)
        if not math.isclose(old, new, rel_tol=1e-6):
            break
    else:
        return None
    was, will = _apart(old, new)
    line = (f"the learning rate at step {step:,} goes from {was} to {will}" if at == step else
            f"the learning rate's schedule changes from step {at:,}, where it will be {will}, not {was}")
    if train.lr_decay_iters is None and before.lr_decay_iters is None and before.max_iters != train.max_iters:
        line += (f": train.lr_decay_iters follows train.max_iters; to keep the saved run's decay, add "
                 f"train.lr_decay_iters={before.max_iters}")
    return line


def _apart(a: float, b: float) -> tuple[str, str]:
    """a and b written with 3 significant digits, or as many more (up to 17) as it takes to tell them apart: a
    resume past a finished 1,500-step run with max_iters=1,510 said its rate "goes from 0.001 to 0.001" (0.001001)."""
    for digits in range(3, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def orthogonalize(m: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The matrix nearest m with every singular value near 1 (m's singular vectors kept): NEWTON_SCHULZ_STEPS steps
    of the odd polynomial NEWTON_SCHULZ on m scaled to a Frobenius norm of 1, which bounds its singular values by 1.
    With products of the shorter side (x x^T is rows x rows, rows <= columns), in dtype (default m's: a run in
    bfloat16 orthogonalises in bfloat16, as torch.optim.Muon always does); m may be a stack of matrices (..., rows,
    columns), each orthogonalised alone."""
    a, b, c = NEWTON_SCHULZ
    tall = m.size(-2) > m.size(-1)
    x = _normalised(m.mT if tall else m, dtype)
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.to(m.dtype)
    return x.mT if tall else x


def orthogonalize_each(matrices: list[torch.Tensor], dtype: torch.dtype | None = None,
                       iterate: Callable | None = None) -> list[torch.Tensor]:
    """orthogonalize of each matrix, in batches: the blocks' matrices come in a few shapes repeated per layer, and a
    batched product runs faster than many small ones.

    In float32 (dtype None or float32) by way of the Gram matrices (gram_newton_schulz): every matrix whose shorter
    side is the same (a GPT block's four: 3d x d, d x d, 4d x d, d x 4d) iterates as one batch of d x d products,
    with a third fewer multiply-adds than orthogonalize's. Measured on a 2-core Zen 2 EPYC (AVX2), 2 threads, eager:
    the matrices of tiny.yaml's model (12, d = 64) 6.1 -> 3.4-3.5 ms, those of the CPU config's (16, d = 128)
    28.6-29.5 -> 17.2-17.7 ms; whole Muon steps, interleaved in one process, tiny.yaml 42.0 -> 40.4 ms and the CPU
    config 113.7 -> 98.3 ms (medians of 12 rounds). Its rounding compounds through the Gram's steps: against
    float64, up to 4e-5 of the update for square matrices and 1.5e-6 for wide ones, where x's own steps keep
    1e-6 to 2e-6 (and torch.optim.Muon's bfloat16, 3e-2). In bfloat16 the Gram's steps compound far more (up to 52
    times the update's size, a 16 x 16 matrix), so a 16-bit dtype keeps orthogonalize's iteration, a batch per
    shape. iterate: gram_newton_schulz's, in float32."""
    if not matrices:
        return []
    work = dtype or matrices[0].dtype
    out: list[torch.Tensor] = list(matrices)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, m in enumerate(matrices):  # the tall ones transposed: x x^T is then the smaller product
        key = (min(m.shape), max(m.shape)) if work.itemsize < 4 else (min(m.shape),)
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        by_shape: dict[int, list[int]] = {}
        for i in members:
            by_shape.setdefault(max(matrices[i].shape), []).append(i)
        wide = [torch.stack([_wide(matrices[i]) for i in same]) for same in by_shape.values()]
        done = ([orthogonalize(wide[0], dtype)] if work.itemsize < 4 else
                gram_newton_schulz([_normalised(x, dtype) for x in wide], iterate))
        for same, stack in zip(by_shape.values(), done, strict=True):
            for i, o in zip(same, stack.unbind(), strict=True):
                out[i] = (o.mT if matrices[i].size(0) > matrices[i].size(1) else o).to(matrices[i].dtype)
    return out


def _wide(m: torch.Tensor) -> torch.Tensor:
    """m with at least as many columns as rows: transposed if it is tall."""
    return m.mT if m.size(-2) > m.size(-1) else m


def _normalised(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x scaled to a Frobenius norm of 1 (each matrix of a stack alone), in dtype: orthogonalize's first step."""
    return (x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)).to(dtype or x.dtype)


def gram_newton_schulz(stacks: list[torch.Tensor], iterate: Callable | None = None) -> list[torch.Tensor]:
    """orthogonalize's iteration for stacks of normalised wide matrices (each (k, rows, columns_i), the same rows),
    carried out on their Gram matrices G = x x^T, rows x rows, all stacks in one batch.

    A step takes x to P x with P = a + b G + c G^2, a polynomial in G; so x's Gram becomes P G P, and after the
    last step x is Q x0, with Q the product of the steps' P (they commute: all are polynomials in the first G).
    Only the first Gram and the last product touch the long side; orthogonalize multiplies by it twice a step.
    iterate takes the Gram matrices to Q (newton_schulz_iteration's, by default; training/muon_kernel.py's)."""
    q = (iterate or newton_schulz_iteration)(torch.cat([x @ x.mT for x in stacks]))
    return [part @ x for part, x in zip(q.split([x.size(0) for x in stacks]), stacks, strict=True)]


def newton_schulz_iteration(gram: torch.Tensor) -> torch.Tensor:
    """Q, the product of the iteration's steps P, for each Gram matrix of gram (count, rows, rows): each step P = a +
    b G + c G^2, Q = P Q, G = P G P (gram_newton_schulz)."""
    a, b, c = NEWTON_SCHULZ
    eye = torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)
    q = None
    for k in range(NEWTON_SCHULZ_STEPS):
        p = torch.baddbmm(torch.add(a * eye, gram, alpha=b), gram, gram, alpha=c)
        q = p if q is None else p @ q
        if k + 1 < NEWTON_SCHULZ_STEPS:
            gram = p @ gram @ p
    return q


def muon_lr_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """What Muon multiplies the learning rate by for a matrix of this shape: 0.2 sqrt(max(rows, columns)), which gives
    its update about the root-mean-square size of AdamW's (Moonshot AI, "Muon is Scalable for LLM Training", 2025),
    so that both halves of the model train with one learning_rate and weight_decay."""
    return 0.2 * math.sqrt(max(shape))


def compiler_loaded() -> bool:
    """Whether this process has imported torch's compiler (torch._dynamo): until it has, nothing can be compiling."""
    return "torch._dynamo" in sys.modules


def _as_torch_runs(method: Callable) -> Callable:
    """One of torch.optim.Optimizer's methods that torch wraps in torch._disable_dynamo, as the run needs it: the
    wrapper, which imports torch's compiler on its first call, once the compiler is loaded; before, the method itself
    (functools' __wrapped__), which is all that the wrapper calls while nothing compiles."""
    return method if compiler_loaded() else getattr(method, "__wrapped__", method)


class CompilerFreeOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer, but a run that compiles nothing never imports torch's compiler through it.

    torch keeps torch.compile out of add_param_group, zero_grad, state_dict and load_state_dict with a wrapper that
    imports torch._dynamo when first called, and the optimizer's constructor calls add_param_group: so every eager
    train.py paid for that import, 1.65 s on a 2-core Zen 4 (torch's own import is 1.9 s), before its first step.
    These call the same methods without the wrapper until something else has imported the compiler."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _as_torch_runs(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _as_torch_runs(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _as_torch_runs(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _as_torch_runs(torch.optim.Optimizer.load_state_dict)(self, state_dict)


class AdamW(CompilerFreeOptimizer, torch.optim.AdamW):
    """torch.optim.AdamW, its class, state and steps, without importing torch's compiler (CompilerFreeOptimizer).

    torch.optim.AdamW's step imports it on every call, to tell torch.compile where to split a graph that traces
    it; tinychar never traces the optimizer (the compiled step runs its own update, see training/compiled_step.py), so
    this steps with AdamW's own code (functools' __wrapped__, under the wrappers), in the gradient mode torch's wrapper
    sets."""

    _step = staticmethod(inspect.unwrap(torch.optim.AdamW.step))

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return self._step(self, closure)


class Muon(CompilerFreeOptimizer):
    """Muon (momentum orthogonalised) for the param groups marked ``muon``, AdamW for the others, in one optimizer.

    A Muon matrix keeps a momentum buffer B <- mu B + (1 - mu) g and steps along orthogonalize((1 - mu) g + mu B)
    (Nesterov's form; torch.optim.Muon's buffer), scaled by muon_lr_scale, after decoupled weight decay: each step
    moves every direction of the matrix by about as much, instead of mostly along the few directions that dominate
    its gradient. AdamW's groups step exactly as
    torch.optim.AdamW would (its fused kernel where the device has one), with its state in the same layout.
    """

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float = 1e-8,
                 momentum: float = MUON_MOMENTUM, fused: bool = False, orthogonal_dtype: torch.dtype | None = None,
                 ) -> None:
        for group in groups:
            if group.get("muon") and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon's groups take matrices only")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "momentum": momentum, "muon": False,
                    "fused": fused}
        super().__init__(groups, defaults)
        self.orthogonal_dtype = orthogonal_dtype  # orthogonalize's dtype (None: the gradients' own)
        self.iterate: Callable | None = None  # the Newton-Schulz iteration's kernel, if any (training/muon_kernel.py)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon(group, params)
            elif params:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
        ahead = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            ahead.append(p.grad.lerp(buf, mu))
        for p, update in zip(params, orthogonalize_each(ahead, self.orthogonal_dtype, self.iterate),
                             strict=True):
            p.mul_(1 - lr * decay)
            p.add_(update, alpha=-lr * muon_lr_scale(p.shape))

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if not state:  # torch.optim.AdamW's layout, so that the compiled step reads it alike
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
            [s["step"] for s in states], fused=group["fused"] or None, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon steps: the weight matrices of the model's linear layers, but not the output head nor a
    weight shared with an embedding (the tied head), which, as the embeddings, biases and norms, stay with AdamW."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        embedded.add(id(head.weight))
    seen: set[int] = set()
    out = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.requires_grad and id(m.weight) not in embedded | seen:
            seen.add(id(m.weight))
            out.append(m.weight)
    return out


def orthogonal_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """What Muon orthogonalises in for a run in dtype: bfloat16 in a bfloat16 run (where the hardware multiplies it
    fastest), else the gradients' float32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else None


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """train.optimizer: AdamW with weight decay on matrices (linear weights, embeddings) and none on biases and norms;
    or Muon, which takes the blocks' matrices (muon_matrices) from AdamW's decayed group into a group of its own
    (dtype: the run's, see orthogonal_dtype)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = {id(p) for p in muon_matrices(model)} if cfg.optimizer == "muon" else set()
    decay = [p for p in params if p.dim() >= 2 and id(p) not in matrices]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one call: fewer kernel launches on CPU and CUDA alike.
    fused = device.type in ("cpu", "cuda")
    if cfg.optimizer == "muon":
        muon = [p for p in params if id(p) in matrices]
        # Muon steps by learning_rate x muon_lr_scale, a float32 number: past float32's largest, torch refuses the
        # step with a traceback at step 1 (AdamW's steps overflow to infinity and the run stops as diverged).
        scale = max((muon_lr_scale(p.shape) for p in muon), default=0.0)
        if cfg.learning_rate * scale > FLOAT32_MAX:
            raise UsageError(f"train.learning_rate={cfg.learning_rate:g} is too large for Muon: scaled by up to "
                             f"{scale:.3g} for this model's matrices, its steps pass float32's largest number; give a "
                             f"learning rate below {FLOAT32_MAX / scale:.3g}")
        groups.append({"params": muon, "weight_decay": cfg.weight_decay, "muon": True})
        return Muon(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused,
                    orthogonal_dtype=orthogonal_dtype(dtype))
    return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)
