"""The compiled training step: a whole optimizer step (forward and backward of every micro-batch, gradient clipping
and the update of AdamW, or of Muon's matrices) as one function that torch.compile turns into one graph.

Why the whole step: at block 8 a CPU step is operator overhead (MFU under 10%). Compiling the model alone still
leaves the autograd engine, gradient accumulation into .grad, the clipping norms and the optimizer as separate
operators; one graph removes them (measured on a 2-core AVX-512 EPYC, block 8, batch 32, 3 layers of 32: eager
4.0 ms/step, compiled model plus compiled optimizer 2.4 ms, the whole step 1.75 ms).

The step works on the optimizer's own state tensors (step, exp_avg, exp_avg_sq), in place, so checkpoints, resume
and the eager path see one optimizer. When a run takes this step, and what it does where it cannot:
training/engine.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from . import attention_kernel, gelu_kernel, linear_kernel, muon_kernel, paired_step, step_file
from .c_kernels import side_by_side
from .compile_cache import compile_options
from .config import TrainConfig
from .devices import autocast_context, random_kept
from .signals import interrupting
from .step_update import Layout, Setup, paired_part, paired_update, update


def module_settings(model: nn.Module) -> str:
    """Every setting of model and its submodules that its forward can read, other than tensors and the training
    mode: each module's type and plain attributes (sizes, dropout probabilities, eps, model/linear.py's oneDNN rows,
    ...) and how many hooks it has, as one digest. The compiled step is told it as a constant instead of guarding
    on the module (see step_guards): two models whose settings differ compile apart."""
    plain = (bool, int, float, str, type(None), torch.dtype)

    def is_setting(v: object) -> bool:
        return (isinstance(v, plain) or isinstance(v, tuple) and all(isinstance(x, plain) for x in v)
                or dataclasses.is_dataclass(v) and not isinstance(v, type))  # GPT.config

    parts = []
    for name, m in model.named_modules():
        attrs = sorted((k, repr(v)) for k, v in vars(m).items()
                       if not k.startswith("_") and k != "training" and is_setting(v))
        hooks = [len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                              "_backward_pre_hooks")]
        parts.append(f"{name}:{type(m).__module__}.{type(m).__qualname__}{attrs}{hooks}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()


# What dynamo checks before each call of the compiled step: the tensors' shapes, dtypes and strides, the layout and
# the setup, and torch's global state (grad mode, autocast, deterministic algorithms...). Left alone it also checks
# every attribute of every submodule the trace read and the functions it called, about 600 checks in all for the
# block-8 step of bench.py, which cost that step 0.14 ms of its 1.64 (2-core Zen 4 EPYC, 2 threads, in one process,
# 30 interleaved rounds of 100 steps, medians). Setup.module holds the model's settings instead, and Setup.training
# its mode. A module changed after its CompiledStep was built (a setting, a hook) or a function of the model or of
# torch replaced at run time is not noticed: build a new CompiledStep.
#
# torch.compile takes a guard_filter_fn from torch 2.8 on; before that it refuses the option ("Unexpected
# optimization option"), and the step keeps every guard.
GUARD_FILTER = torch.__version__ >= "2.8"


def step_options(device: torch.device) -> dict:
    """torch.compile's options for the whole step: inductor's (compile_options) and the guards it keeps."""
    options = compile_options(device)
    if GUARD_FILTER:
        options["guard_filter_fn"] = step_guards
    return options


def step_guards(entries: list) -> list[bool]:
    """torch.compile's guard_filter_fn for the compiled step: which of dynamo's guards to keep (see above)."""
    keep = []
    for e in entries:
        source = e.orig_guard.name  # "" for torch's global state, L['...'] for an argument, G['...'] for a global
        if e.guard_type == "TENSOR_MATCH":  # inputs and buffers; parameters are replaced from the flat buffer
            keep.append(not isinstance(e.value, nn.Parameter))
        else:
            keep.append(source == "" or source.startswith("L[") and not source.startswith("L['model']"))
    return keep


def _whole_step(model: nn.Module, flat: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                steps: torch.Tensor, momentum: torch.Tensor, decay: torch.Tensor, owner: torch.Tensor, xs: torch.Tensor,
                ys: torch.Tensor, lr: torch.Tensor, layout: Layout, setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of every micro-batch, clipping, and the optimizer's update in place on the flat buffers:
    what CompiledStep compiles (see _gradients and step_update.update)."""
    grad, loss_sum = _gradients(model, flat, xs, ys, layout, setup)
    return update(flat, exp_avg, exp_avg_sq, steps, momentum, decay, owner, grad, loss_sum, lr, layout, setup)


def _gradients(model: nn.Module, flat: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor, layout: Layout,
               setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of the flat weights and the loss, summed over the micro-batches xs, ys (accum, rows, T): of the
    whole batch, or of one of its setup.parts (training/paired_step.py), each part's share of the mean."""
    # Read here so that dynamo checks them before each call, in place of the model's attributes (see step_guards).
    if not setup.module or setup.training != model.training:
        raise ValueError("the compiled step's setup does not describe its model (see CompiledStep.constants)")

    def loss_of(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_context(torch.device(setup.device_type), setup.dtype):
            _, loss = torch.func.functional_call(model, layout.unflatten(flat), (x, y))
        return loss / (setup.accum * setup.parts)

    grad, loss_sum = None, None
    for micro in range(setup.accum):
        g, loss = torch.func.grad_and_value(loss_of)(flat, xs[micro], ys[micro])
        grad = g if grad is None else grad + g
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return grad, loss_sum


def lr_argument(lr: float, device: torch.device) -> torch.Tensor:
    """The learning rate as _whole_step takes it: float64, one value, which the step makes a 0-dim tensor again (so
    that it multiplies float32 values as a Python float would). A 0-dim float64 argument is what dynamo makes of a
    Python float it traces, and it traced the step twice for it: the second time with that value made a constant,
    which the learning rate is not (torch 2.13: the first trace 2.7 s of a one-layer step's 15 s compile, 2-core Zen
    2 EPYC, 2026-12-06)."""
    return torch.tensor([lr], dtype=torch.float64, device=device)


_COMPILED: dict[Callable, Callable] = {}


class deterministic_kernels:  # lower case: a context, used as torch.no_grad is
    """On a CPU, PyTorch's deterministic algorithms for the compiled step, traced and run under them alike (dynamo
    guards on the setting). Without them inductor sums the token embedding's gradient with atomic adds from every
    thread, in whatever order the threads reach a row, and a compiled run did not repeat itself. Measured on a 2-core
    Zen 4 EPYC, 2 threads: six compiled steps of nanoGPT's CPU config from the same weights and batch gave five
    different embedding gradients; train.py with bench.py's block-8 step settings, 5,100 compiled steps, ended on
    seven different losses in seven runs (1.8737-1.9061), and now on one (1.9145) every time. Under them inductor
    calls PyTorch's own index_put, which adds in one order, at no cost measured (in one process, rounds interleaved,
    median ms a step: block 8 1.491 -> 1.496 over 12 rounds, and 3.65 -> 3.64 in a slow spell; block 64 33.99 ->
    33.78).
    Memory that PyTorch leaves uninitialised stays so (filling it finds bugs; determinism does not need it). CUDA
    keeps its kernels: not measured there.

    Entered around every call of the step, so through torch's C setters rather than torch.use_deterministic_algorithms
    (3.4 us a call against 0.4) and as a class rather than a generator: with the learning rate's tensor kept
    (CompiledStep._run), the bench's block-8 step 2.439 -> 2.379 ms (2-core Zen 2, 2 threads, one process, medians of
    20 interleaved rounds of 500 steps, 19 faster), the same bits."""

    __slots__ = ("cpu", "saved")

    def __init__(self, device: torch.device) -> None:
        self.cpu = device.type == "cpu"

    def __enter__(self) -> None:
        if self.cpu:
            c = torch._C
            self.saved = (c._get_deterministic_algorithms(), c._get_deterministic_algorithms_warn_only(),
                          c._get_deterministic_fill_uninitialized_memory())
            c._set_deterministic_algorithms(True, warn_only=True)
            c._set_deterministic_fill_uninitialized_memory(False)

    def __exit__(self, *exc: object) -> None:
        if self.cpu:
            enabled, warn_only, fill = self.saved
            torch._C._set_deterministic_algorithms(enabled, warn_only=warn_only)
            torch._C._set_deterministic_fill_uninitialized_memory(fill)


def _concat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One new contiguous buffer holding the tensors' values end to end, and its slices shaped as each tensor: the
    same values, now one block of memory that one compiled kernel updates."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return flat, [part.view_as(t) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True)]


class CompiledStep:
    """One optimizer step as one compiled function, updating the model's parameters and the optimizer's state in
    place. Call it with the micro-batches stacked, xs and ys (grad_accum_steps, batch, T), and the learning rate;
    it returns (summed mean loss, gradient norm before clipping). If either is not finite, nothing is updated.

    The parameters, and each of AdamW's state tensors, become views of one flat buffer apiece: the update is then
    one fused kernel over all the weights instead of one per parameter, which halves the time to compile the step
    (measured, tiny.yaml's model, 2-core AVX-512 EPYC: 60 -> 27 s cold) and speeds the step (12.8 -> 10.5 ms). The
    model, the optimizer, checkpoints and the eager path see the same tensors as before, views or not."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.AdamW, tc: TrainConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model, self.tc, self.device, self.dtype = model, tc, device, dtype
        parts = paired_step.paired_rule(model, tc.batch_size, device, dtype,
                                        muon=any(group.get("muon") for group in optimizer.param_groups))
        newton_schulz = False  # Muon's iteration through training/muon_kernel.py
        if device.type == "cpu" and dtype == torch.float32:  # kernels of our own, where they apply and pay
            rows = tc.batch_size // parts * getattr(getattr(model, "config", None), "block_size", 0)
            # each built where it is not in the cache yet, side by side (c_kernels.side_by_side)
            newton_schulz = side_by_side([*(partial(attach, model, rows=rows) for attach in (
                attention_kernel.attach, gelu_kernel.attach, linear_kernel.attach)), partial(muon_kernel.ready,
                                                                                             optimizer)])[-1]
        named = {id(p): name for name, p in model.named_parameters()}  # a tied weight once, under its first name
        params: list[torch.Tensor] = []
        states: list[dict[str, torch.Tensor]] = []
        decay: list[float] = []
        matrices: list[torch.Tensor] = []  # Muon's (training.optim.Muon), laid out after AdamW's
        matrix_states: list[dict[str, torch.Tensor]] = []
        matrix_decay = 0.0
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if group.get("muon"):
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    matrices.append(p)
                    matrix_states.append(state)
                    matrix_decay = group["weight_decay"]
                    continue
                if not state:  # the layout torch's fused AdamW uses, so that either can continue the other
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                states.append(state)
                decay.append(group["weight_decay"])
        if len({(p.dtype, p.device) for p in params + matrices}) > 1:
            raise RuntimeError("the compiled step needs every parameter in one dtype on one device")
        every = params + matrices
        self.layout = Layout(tuple(named[id(p)] for p in every), tuple(p.numel() for p in every),
                             tuple(tuple(p.shape) for p in every), len(matrices))
        self.flat, views = _concat(every)
        for p, view in zip(every, views, strict=True):
            p.data = view
        self.exp_avg, self.exp_avg_sq = (self._flat_state(states, key) for key in ("exp_avg", "exp_avg_sq"))
        self.momentum = (self._flat_state(matrix_states, "momentum_buffer") if matrices
                         else torch.zeros(0, dtype=self.flat.dtype, device=device))
        self.steps = torch.stack([s["step"].float() for s in states])  # (parameters,)
        for i, s in enumerate(states):
            s["step"] = self.steps[i]
        sizes = torch.tensor([p.numel() for p in params], device=device)
        self.owner = torch.arange(len(params), dtype=torch.int32, device=device).repeat_interleave(sizes)  # (values,)
        self.decay = torch.tensor(decay, dtype=self.flat.dtype, device=device)[self.owner]  # (values,)
        self.betas: tuple[float, float] = optimizer.defaults["betas"]
        self.eps: float = optimizer.defaults["eps"]
        # What the compiled code takes as constants (dynamo guards on their values).
        same_steps = bool((self.steps == self.steps[0]).all())
        self.setup = Setup(device.type, dtype, tc.grad_accum_steps, tc.grad_clip, self.betas, self.eps, same_steps,
                           optimizer.defaults.get("momentum", 0.0) if matrices else 0.0, matrix_decay,
                           module_settings(model), parts=parts,
                           newton_schulz=muon_kernel.DIGEST if newton_schulz and matrices else "")
        self.lr = lr_argument(0.0, device)  # the learning rate's argument, refilled at each call
        # the last call's shapes and mode, and the functions compiled for them
        self._last: tuple[tuple, dict[tuple[Callable, int], Callable]] | None = None
        self.source = ""  # where the compiled function came from (step_file.step_function): said in the log
        self._parts: tuple[int, int, tuple[Layout, Layout]] | None = None  # part_args's division of the buffers

    @staticmethod
    def _flat_state(states: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
        flat, views = _concat([s[key] for s in states])
        for s, view in zip(states, views, strict=True):
            s[key] = view
        return flat

    def compiled(self, fn: Callable) -> Callable:
        """torch.compile's own fn (a step function of this module), with its guards: where step_file cannot compile
        the step ahead of time (a torch before 2.10, or a failure of that API). One compiled function for every
        CompiledStep of the process: a model of the same shapes (a resumed run, a second run in one process) reuses
        its compiled code."""
        if fn not in _COMPILED:
            _COMPILED[fn] = torch.compile(fn, fullgraph=True, dynamic=False, options=step_options(self.device))
        return _COMPILED[fn]

    @property
    def parts(self) -> int:
        """The parts each micro-batch is split into, each a thread's (training/paired_step.py)."""
        return self.setup.parts

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.flat, self.exp_avg, self.exp_avg_sq, self.steps, self.momentum

    def constants(self) -> Setup:
        """The setup, with the model's mode now (the trainer's is always training)."""
        return self.setup if self.model.training else self.setup._replace(training=False)

    def _run(self, buffers: tuple[torch.Tensor, ...], xs: torch.Tensor, ys: torch.Tensor,
             lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.lr.fill_(lr)  # into the same tensor each step: one fewer to make (see deterministic_kernels)
        setup = self.constants()
        # the gradients are taken inside; the updates are in place
        with torch.no_grad(), deterministic_kernels(self.device):
            if setup.parts == 1:
                args = (self.model, *buffers, self.decay, self.owner, xs, ys, self.lr, self.layout, setup)
                return self._function(_whole_step, args, xs, ys)(*args)
            flat, exp_avg, exp_avg_sq, steps, momentum = buffers
            half = xs.size(1) // 2
            first, second = ((self.model, flat, x, y, self.layout, setup)
                             for x, y in ((xs[:, :half], ys[:, :half]), (xs[:, half:], ys[:, half:])))
            with paired_step.one_thread():  # each half's code compiled for one thread, and run on one
                gradients = self._function(_gradients, first, xs, ys)
                if gradients is _COMPILED.get(_gradients):  # dynamo's guards are not for two threads at once
                    (grad_a, loss_a), (grad_b, loss_b) = gradients(*first), gradients(*second)
                else:
                    (grad_a, loss_a), (grad_b, loss_b) = paired_step.both(gradients, first, second)
                if self.layout.matrices == 0:
                    args = (flat, exp_avg, exp_avg_sq, steps, momentum, self.decay, self.owner, grad_a, loss_a,
                            grad_b, loss_b, self.lr, self.layout, setup)
                    return self._function(paired_update, args, xs, ys)(*args)
                first, second = self.part_args(buffers, (grad_a, loss_a, grad_b, loss_b), setup)
                part = self._function(paired_part, first, xs, ys, 0), self._function(paired_part, second, xs, ys, 1)
                if part[0] is _COMPILED.get(paired_part):  # with dynamo's guards: in turn, as the halves
                    result = part[0](*first)
                    part[1](*second)
                    return result
                return paired_step.both(part[0], first, second, part[1])[0]

    def part_args(self, buffers: tuple[torch.Tensor, ...], halves: tuple[torch.Tensor, ...],
                  setup: Setup) -> tuple[tuple, tuple]:
        """The arguments of step_update.paired_part for each part, each a thread's: with Muon, the update of the halves'
        gradients in two parts. Muon's orthogonalisation is most of a small model's update, and on one thread
        beside the halves it cost more than they gained (tiny.yaml's step 16.56 -> 17.36 ms), while a team of two
        threads for it left its second spinning into the next step's halves (23.41). So the first part takes AdamW's
        parameters and the first half of the matrices, the second the others; both at once, one a thread, each on
        its own slices of the buffers: tiny.yaml's step 13.64 -> 13.12 ms against the whole batch's, bench.py's
        block-8 shape with Muon 3.02 -> 2.22 (2-core Zen 2, in one process, six rounds in turn; the other shapes
        measured in training/paired_step.py). Each part orthogonalises its own matrices, in batches of their own:
        the same arithmetic, to float32's rounding."""
        flat, exp_avg, exp_avg_sq, steps, momentum = buffers
        if self._parts is None:  # where the parts divide the buffers: the same for every step
            names, sizes, shapes, matrices = self.layout
            first = len(names) - matrices + matrices // 2  # the parameters of the first part
            self._parts = (sum(sizes[:first]), sum(sizes[len(names) - matrices:first]),
                           (Layout(names[:first], sizes[:first], shapes[:first], matrices // 2),
                            Layout(names[first:], sizes[first:], shapes[first:], matrices - matrices // 2)))
        cut, in_momentum, layouts = self._parts
        none = exp_avg[:0]
        return ((flat[:cut], exp_avg, exp_avg_sq, steps, momentum[:in_momentum], self.decay, self.owner, *halves,
                 self.lr, 0, layouts[0], setup),
                (flat[cut:], none, none, steps[:0], momentum[in_momentum:], self.decay[:0], self.owner[:0], *halves,
                 self.lr, cut, layouts[1], setup))

    def _function(self, fn: Callable, args: tuple, xs: torch.Tensor, ys: torch.Tensor, part: int = 0) -> Callable:
        """The compiled fn for args (part: which of fn's calls in a step, where it makes more than one): the last
        call's where the batch's shape and the model's mode are the same (the step saved whole has no guards to tell
        them apart: see training/step_file.py), else step_file's, else torch.compile's own (self.compiled)."""
        call = (xs.shape, xs.stride(), xs.dtype, ys.shape, ys.stride(), ys.dtype, self.model.training)
        if self._last is None or self._last[0] != call:
            self._last = (call, {})
        functions = self._last[1]
        if (fn, part) in functions:
            return functions[fn, part]
        function = None
        if step_file.used_on(self.device):
            try:
                function, self.source = step_file.step_function(fn, args, self.device)
            except Exception as e:  # noqa: BLE001 - torch.compile's own compile follows, and says what fails
                if (stop := interrupting(e)) is not None:
                    raise stop from None
        if function is None:
            function, self.source = self.compiled(fn), "compiled with guards"
        functions[fn, part] = function
        return function

    def __call__(self, xs: torch.Tensor, ys: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(self.buffers(), xs, ys, lr)

    def warm_up(self, xs: torch.Tensor, ys: torch.Tensor) -> float:
        """Compile now (or load the step compiled before: self.source says which), on copies of the weights and
        state, so that a failure leaves the run untouched and the first real step is not the slow one; the seconds
        it took."""
        start = time.perf_counter()
        with random_kept(self.device):  # dropout inside the warm-up must not shift the run's random streams
            self._run(tuple(t.clone() for t in self.buffers()), xs, ys, 0.0)
        return time.perf_counter() - start
