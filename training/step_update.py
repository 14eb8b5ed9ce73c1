"""The optimizer's update as the compiled training step runs it (training/compiled_step.py): clipping, then AdamW's
update and Muon's of the matrices, in place on the flat buffers that hold the weights and the optimizer's state, and a
step that is not finite changing nothing. Its pieces: update for the whole batch, paired_update for the gradients of
its two halves (training/paired_step.py), and paired_part for each of the two parts that update takes with Muon, one
a thread. The constants they are compiled with (Setup) and where each parameter lies in the buffers (Layout) are here
too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import muon_kernel
from .optim import muon_lr_scale, orthogonal_dtype, orthogonalize_each


class Setup(NamedTuple):
    """The constants of a compiled step."""

    device_type: str
    dtype: torch.dtype
    accum: int
    clip: float
    betas: tuple[float, float]
    eps: float
    same_steps: bool  # every parameter has taken as many steps (always so, unless a checkpoint says otherwise)
    momentum: float = 0.0  # Muon's, for the matrices at the end of the layout (train.optimizer=muon)
    matrix_decay: float = 0.0  # their weight decay
    module: str = ""  # module_settings of the model: what its traced code reads of it besides its parameters
    training: bool = True  # the model's mode when called
    parts: int = 1  # the batch's parts, each a thread's (training/paired_step.py)
    newton_schulz: str = ""  # Muon's iteration through training/muon_kernel.py: its digest (DIGEST), else ""


class Layout(NamedTuple):
    """Where each parameter lies in the flat buffers: its name, number of values and shape, in optimizer order; the
    last `matrices` of them are Muon's (train.optimizer=muon), the others AdamW's."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    matrices: int = 0

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, flat.split(self.sizes), self.shapes, strict=True)}


def paired_update(flat: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: torch.Tensor,
                  momentum: torch.Tensor, decay: torch.Tensor, owner: torch.Tensor, grad_a: torch.Tensor,
                  loss_a: torch.Tensor, grad_b: torch.Tensor, loss_b: torch.Tensor, lr: torch.Tensor, layout: Layout,
                  setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """The update from the two halves' gradients and losses (compiled_step._gradients of each), added in one order."""
    return update(flat, exp_avg, exp_avg_sq, steps, momentum, decay, owner, grad_a + grad_b, loss_a + loss_b, lr,
                  layout, setup)


def paired_part(weights: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: torch.Tensor,
                momentum: torch.Tensor, decay: torch.Tensor, owner: torch.Tensor, grad_a: torch.Tensor,
                loss_a: torch.Tensor, grad_b: torch.Tensor, loss_b: torch.Tensor, lr: torch.Tensor, start: int,
                layout: Layout, setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """One of the two parts of paired_update with Muon (see compiled_step.CompiledStep.part_args), each a thread's:
    the update of weights, the flat buffer's values from start on, laid out as layout says (AdamW's state empty in
    the part that has none of its parameters). Both parts clip by the norm of the whole gradient, and stop on the
    same test."""
    grad = grad_a + grad_b
    norm = torch.linalg.vector_norm(grad.float())
    mine = grad[start:start + weights.numel()]
    return apply_update(weights, exp_avg, exp_avg_sq, steps, momentum, decay, owner, mine, loss_a + loss_b, norm, lr,
                        layout, setup)


def update(flat: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: torch.Tensor,
           momentum: torch.Tensor, decay: torch.Tensor, owner: torch.Tensor, grad: torch.Tensor,
           loss_sum: torch.Tensor, lr: torch.Tensor, layout: Layout,
           setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping and the optimizer's update in place on the flat buffers; (loss_sum, the gradient's norm)."""
    norm = torch.linalg.vector_norm(grad.float())
    return apply_update(flat, exp_avg, exp_avg_sq, steps, momentum, decay, owner, grad, loss_sum, norm, lr, layout,
                        setup)


def apply_update(flat: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: torch.Tensor,
                 momentum: torch.Tensor, decay: torch.Tensor, owner: torch.Tensor, grad: torch.Tensor,
                 loss_sum: torch.Tensor, norm: torch.Tensor, lr: torch.Tensor, layout: Layout,
                 setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """The update of flat from grad, clipped by norm: AdamW updates the first exp_avg.numel() values of flat (none
    in the second part of a paired update): steps holds a value per AdamW parameter, decay one per such value, and
    owner the parameter each belongs to. Muon updates the rest (the layout's last `matrices` parameters), whose
    momentum buffers lie end to end in momentum."""
    lr = lr.reshape(())  # see compiled_step.lr_argument
    scale = torch.ones((), device=norm.device)
    if setup.clip > 0:  # as clip_grad_norm_ does it
        scale = torch.clamp(setup.clip / (norm + 1e-6), max=1.0)
    ok = torch.isfinite(loss_sum) & torch.isfinite(norm)
    n = exp_avg.numel()
    new = []
    if n:
        new_steps, step_size, root_bias2, scale = adamw_factors(steps, ok, lr, scale, owner, setup)
    g = grad * scale
    if n:
        beta1, beta2 = setup.betas
        new_avg = exp_avg.lerp(g[:n], 1 - beta1)
        new_avg_sq = exp_avg_sq * beta2 + g[:n] * g[:n] * (1 - beta2)
        denom = new_avg_sq.sqrt() / root_bias2 + setup.eps
        new.append(flat[:n] * (1 - lr * decay) - step_size * new_avg / denom)
    if layout.matrices:  # Muon
        moved, new_momentum = muon_step(g[n:], flat[n:], momentum, lr, layout, setup)
        new += moved
        momentum.copy_(torch.where(ok, new_momentum, momentum))
    # A step that is not finite changes nothing: the run stops and reports it with its weights intact.
    flat.copy_(torch.where(ok, new[0] if len(new) == 1 else torch.cat(new), flat))
    if n:
        exp_avg.copy_(torch.where(ok, new_avg, exp_avg))
        exp_avg_sq.copy_(torch.where(ok, new_avg_sq, exp_avg_sq))
        steps.copy_(new_steps)
    return loss_sum, norm


def adamw_factors(steps: torch.Tensor, ok: torch.Tensor, lr: torch.Tensor, scale: torch.Tensor, owner: torch.Tensor,
                  setup: Setup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW's new step counts, its step size and the root of its second bias correction (for each value, or one
    for all), and the clip's scale, as apply_update reads them."""
    beta1, beta2 = setup.betas
    new_steps = steps + ok.float()
    # Each parameter's own step count, as AdamW keeps it. When all are equal (every run of this trainer: each step
    # updates every parameter) the bias corrections are two numbers; otherwise they are worked out per parameter and
    # read by each value through owner, a gather that keeps the update from vectorising (measured, the block-8 step
    # of bench.py: its update kernel 150 -> 80 us with this and decay read per value, of a 1.3 ms step). Either way
    # the same arithmetic on the same numbers: the same result to the bit.
    if setup.same_steps:
        step_size = lr / (1 - beta1 ** new_steps[:1])  # (1,): float32, as the per-parameter form computes it
        root_bias2 = torch.sqrt(1 - beta2 ** new_steps[:1])
        # Each summed over its one value (the same number, so the same weights to the bit): a reduction, which
        # inductor works out once, before the update's loop. As plain values it inlined them into that loop: both
        # powers and the clip's division again for every 8 values updated. Measured on a 2-core Zen 2 EPYC (AVX2),
        # in one process, 16 interleaved rounds of 20 steps: bench.py's block-8 step 2.18 -> 2.07 ms (median), 15
        # rounds of 16 faster; tiny.yaml's 18.35 -> 18.06 ms; nanoGPT's CPU config about 2%, within its noise.
        step_size, root_bias2, scale = torch.stack([step_size, root_bias2, scale.reshape(1)]).sum(-1).split(1)
    else:
        step_size = (lr / (1 - beta1**new_steps))[owner]
        root_bias2 = torch.sqrt(1 - beta2**new_steps)[owner]
    return new_steps, step_size, root_bias2, scale


def muon_step(g: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor, layout: Layout,
              setup: Setup) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Muon's step of the layout's last `matrices` parameters (weights, their gradients g, end to end), as
    training.optim.Muon takes it: their new values, flat, and the new momentum."""
    mu = setup.momentum
    new_momentum = momentum.lerp(g, 1 - mu)
    ahead = g.lerp(new_momentum, mu)
    sizes, shapes = layout.sizes[-layout.matrices:], layout.shapes[-layout.matrices:]
    updates = orthogonalize_each([d.view(shape) for d, shape in zip(ahead.split(sizes), shapes, strict=True)],
                                 orthogonal_dtype(setup.dtype), muon_kernel.iterate if setup.newton_schulz else None)
    moved = [w * (1 - lr * setup.matrix_decay) - (lr * muon_lr_scale(shape)) * u.flatten()
             for w, u, shape in zip(weights.split(sizes), updates, shapes, strict=True)]
    return moved, new_momentum
