"""Sampling with fixed shapes: every character is one call of the same function on a (batch, block_size) window,
so it can be compiled once and never again, however long the text or however full the window. Eager, with one
character a call, the sampler takes the plain slide instead (fewer operators a character; while the window fills,
a few shapes: see SLIDE_ROWS).

The window holds the last block_size characters at positions 0..n-1 (the learned positions they would have in a
window of their own) and padding after them; under the triangular mask no position sees the padding, and the
logits are read at position n-1. The character is drawn the way torch.multinomial draws one (argmax of the
probabilities over Exp(1) noise), with the noise taken from the caller's generator outside the compiled code, so
the generator moves exactly as it does in ``GPT.generate`` and, for equal logits, the same characters come out.

On a CUDA GPU a character's forward pass is some hundred small kernels, each launched from Python: launching, not
arithmetic, sets the pace. There the sampler keeps its window on the GPU and runs a chunk of characters, unrolled, as
one replay of a CUDA graph captured once (``graph=True``): one launch for all of the chunk's kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch._higher_order_ops import while_loop

from .gpt import GPT, NonFiniteLogits, check_request, check_sampling, filtered_probs, greedy_where_overflowed
from .span import draw_span
from .unrolled import Unrolled

# The most values the first block's looked-up projections (GPT.first_projections) may take: 64 MiB of float32. The
# CPU config's table is 1.6M values, made in 3-5 ms (2 threads, Zen 4 EPYC); shakespeare_char.yaml's would be 19M.
MAX_FIRST_PROJECTIONS = 2**24

# Characters per replay of the CUDA graph (graph=True). Measured on an H200, the 6-layer block-256 model, one stream:
# 8, 16 and 32 a replay all give 1,610-1,650 characters/s (capturing 0.05, 0.19 and 0.25 s); block 8: 16 and 64 the
# same. The last, short chunk of a text computes up to GRAPH_CHUNK - 1 characters nobody reads.
GRAPH_CHUNK = 16

# The eager slide's window, while it fills, runs a multiple of this many rows (padding after the characters, which no
# position sees), so that a window of block_size has at most block_size / SLIDE_ROWS shapes. oneDNN's linear keeps a
# primitive for every shape it multiplies: sampling eagerly from a block-256 model (6 layers of 384) on a Zen 5 EPYC,
# whose products go through oneDNN, held 417 MB more once the window had filled a row at a time.
SLIDE_ROWS = 16

# Below this temperature logits / temperature overflows for ordinary logits (a logit of 4 at 1e-38), each such row
# greedy (greedy_where_overflowed, on every path); such runs take GPT.generate, as they always have. Above it, logits
# near float32's limit overflow too (1e36 at 1e-3), and the window meets them as GPT.generate does.
MIN_FAST_TEMPERATURE = 1e-4


class WindowPass(NamedTuple):
    """A window's final state as one operator (training/window_kernel.py): op(window, n, first, weights, vocab,
    width, heads, layers, bias) -> (B, width), weights the model's packed for it, source a digest of its code."""

    op: Callable[..., torch.Tensor]
    weights: torch.Tensor
    source: str


class WindowSampler:
    """Draws the next characters of every row of a batch from a fixed-shape window; see the module's docstring.

    Each call of ``step`` makes ``chunk`` characters, one forward pass each, so that what a call costs besides its
    arithmetic (Python, torch.compile's guards, copying the window) is paid once per ``chunk`` characters.
    ``compile=True`` runs the step through torch.compile, with inductor's ``options`` (the caller decides where
    that pays: it costs seconds once, then each call is one run of fused code). Eager with ``chunk`` 1 (sample.py's
    eager path), ``generate_iter`` slides a window of the last characters as ``GPT.generate`` does, with
    ``GPT.hidden_at``'s shorter last layer and torch.multinomial: at block 8 about a tenth less time a character
    than the fixed-shape step run eagerly (1 thread, 1,640 against 1,830 characters a second, best of 7), which a
    larger chunk still runs, so that its logic is checked without compiling.

    ``graph=True`` draws ``chunk`` characters a call from buffers that stay on the device (``Unrolled``), on CUDA as
    one replay of a CUDA graph captured at the first call (or ``warm_up``), for the batch size of that call; with
    ``compile`` too, the graph holds the compiled character's kernels. The weights must stay where they are in
    memory while the sampler is used (the graph reads them there). A capture begins by releasing PyTorch's cached GPU
    memory (torch.cuda.empty_cache), which broke compiled training steps taken after it until inductor's mix-order
    reduction was turned off (training.compile_cache.CUDA_OPTIONS; the README's "On a GPU"); training's own samples
    still take GPT.generate (training.logger.sample_text).

    ``ahead(fn, args)``, with ``compile`` (and neither ``graph`` nor a model in training mode), compiles the step ahead
    of time instead: fn is ``run_steps``, args its arguments (``steps``, a WindowSteps, first), and what it returns is
    called in the step's place for arguments of the same shapes, unchecked (training.step_file saves such a step and
    loads it in later runs: seconds sooner than torch.compile's warm start). Where it returns None, torch.compile's
    own step (with dynamo's guards) is used.

    A model in eval mode has its first block's projections looked up (``GPT.first_projections``, up to
    MAX_FIRST_PROJECTIONS values), as they are when the sampler is made: make another after changing the weights.

    ``span`` > 1 draws that many characters a pass of the fixed-shape step (model.span: the coming windows' known rows
    in one batch), the same characters; it is made a divisor of ``chunk`` of at most block_size, and is 1 with
    ``graph``, ``window_pass`` or a model in training mode.

    ``window_pass`` (not with ``graph`` nor in training mode) computes each window's state with one operator instead
    of the model's layers (training/window_kernel.py, a snapshot of the weights as the sampler is made), compiled or
    eager (the slide then passes it windows of block_size, padded while they fill).
    """

    def __init__(self, model: GPT, temperature: float, top_k: int | None, top_p: float | None,
                 compile: bool = False, options: dict | None = None, chunk: int = 1, graph: bool = False,
                 ahead: Callable[[Callable, tuple], Callable | None] | None = None, span: int = 1,
                 window_pass: WindowPass | None = None) -> None:
        check_sampling(temperature, top_k, top_p)
        if 0.0 < temperature < MIN_FAST_TEMPERATURE:
            raise ValueError(f"temperature {temperature} is below {MIN_FAST_TEMPERATURE}: use GPT.generate")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model, self.temperature, self.top_k, self.top_p = model, temperature, top_k, top_p
        self.chunk = chunk
        self.fixed_shape = compile or chunk > 1 or graph
        self.graph = graph
        self.unrolled: Unrolled | None = None
        cfg = model.config
        # The first block's projections looked up rather than computed (in eval mode: no dropout on the embeddings)
        first = None
        if not model.training and cfg.vocab_size * cfg.block_size * 3 * cfg.n_embd <= MAX_FIRST_PROJECTIONS:
            first = model.first_projections()
        # span characters a pass (model.span): a divisor of chunk, at most block_size; not for the CUDA graph's
        # unrolled characters, nor in training mode (dropout: the rows would not be those of a window of their own)
        span = 1 if graph or model.training or window_pass else math.gcd(max(1, min(span, cfg.block_size)), chunk)
        self.steps = WindowSteps(model, first, temperature, top_k, top_p, chunk, span,
                                 None if graph or model.training else window_pass)
        self.step: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self.steps
        self.draw: Callable[..., tuple[torch.Tensor, ...]] = self.steps.draw
        self.options = options
        self.ahead = ahead if compile and not graph and not model.training else None
        self._ahead_steps: dict[tuple, Callable] = {}  # the step compiled ahead, by the shapes it was compiled for
        self._guarded: Callable | None = None
        if compile and graph:  # one character compiled; the graph unrolls the chunk of them
            self.draw = torch.compile(self.steps.draw, fullgraph=True, dynamic=False, options=options)
        elif self.ahead is not None:
            self.step = self._step_ahead
        elif compile:
            self.step = self._guarded_step()

    @property
    def first(self) -> torch.Tensor | None:
        """The first block's projections as they were looked up when the sampler was made (None: computed)."""
        return self.steps.first

    def _guarded_step(self) -> Callable:
        """torch.compile's own step, with dynamo's guards (made once)."""
        if self._guarded is None:
            self._guarded = torch.compile(self.steps.forward, fullgraph=True, dynamic=False, options=self.options)
        return self._guarded

    def _step_ahead(self, window: torch.Tensor, n: torch.Tensor, wanted: torch.Tensor, noise: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step compiled ahead of time by ``ahead`` (for these shapes: it checks nothing when called), or, where
        ``ahead`` gives none, torch.compile's own."""
        shapes = (window.shape, window.device, None if noise is None else noise.shape)
        function = self._ahead_steps.get(shapes)
        if function is None:
            function = self.ahead(run_steps, (self.steps, window, n, wanted, noise))
            if function is None:
                guarded = self._guarded_step()
                function = lambda steps, *args: guarded(*args)  # noqa: E731
            self._ahead_steps[shapes] = function
        return function(self.steps, window, n, wanted, noise)

    @torch.inference_mode()
    def warm_up(self, batch: int, device: torch.device) -> None:
        """Run the step once on a blank window (compiling it, when compiled; capturing its graph, with graph=True),
        without touching any generator."""
        if self.graph:
            self._unrolled(batch, device)
            return
        window = torch.zeros(batch, self.model.config.block_size, dtype=torch.long, device=device)
        count, wanted = (torch.ones(1, dtype=torch.long, device=device) for _ in range(2))  # two: not aliases
        self.step(window, count, wanted, self._noise_buffer(batch, device))

    def _noise_buffer(self, batch: int, device: torch.device) -> torch.Tensor | None:
        if self.temperature == 0:
            return None
        return torch.ones(self.chunk, batch, self.model.config.vocab_size, device=device)

    def generate_iter(self, idx: torch.Tensor, max_new_tokens: int,
                      generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """Yield the next (B, 1) ids of idx's continuation one at a time; the window slides by one character, so
        every prediction sees the last block_size characters (GPT.generate's default). The arguments are checked
        when it is called."""
        check_request(idx, max_new_tokens)
        if not self.fixed_shape:
            return self._slide(idx, max_new_tokens, generator)
        chunks = self._replay if self.graph else self._chunks
        return characters(chunks(idx, max_new_tokens, generator))

    @torch.inference_mode()
    def _chunks(self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None
                ) -> Iterator[tuple[torch.Tensor, int]]:
        """Each chunk's ids (B, chunk) and how many of them were asked for, drawn by the fixed-shape step."""
        block_size = self.model.config.block_size
        B, T = idx.shape
        n = min(T, block_size)
        window = torch.zeros(B, block_size, dtype=idx.dtype, device=idx.device)
        window[:, :n] = idx[:, T - n :]
        count = torch.tensor([n], device=idx.device)
        noise = self._noise_buffer(B, idx.device)
        rows = () if noise is None else noise.unbind(0)  # each character's noise, made once (about 1 us each)
        for done in range(0, max_new_tokens, self.chunk):
            wanted = min(self.chunk, max_new_tokens - done)
            # One draw per character, each of the shape torch.multinomial draws, in the order it would draw them:
            # the generator moves as in GPT.generate.
            for row in rows[:wanted]:
                row.exponential_(generator=generator)
            ids, window, count = self.step(window, count, torch.tensor([wanted], device=idx.device), noise)
            yield ids, wanted

    def _unrolled(self, batch: int, device: torch.device) -> Unrolled:
        """The chunk runner for this batch size on this device, made (and on CUDA captured) at its first use."""
        u = self.unrolled
        if u is None or u.window.size(0) != batch or u.window.device != device:
            self.unrolled = None  # the old graph's memory goes back before the new one is captured
            u = Unrolled(self.draw, self.chunk, batch, self.model.config, device, self.temperature != 0)
            if device.type == "cuda":
                u.capture()
            self.unrolled = u
        return u

    @torch.inference_mode()
    def _replay(self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None
                ) -> Iterator[tuple[torch.Tensor, int]]:
        """_chunks with graph=True: the window stays in the runner's buffers from one chunk to the next."""
        block_size = self.model.config.block_size
        B, T = idx.shape
        n = min(T, block_size)
        u = self._unrolled(B, idx.device)
        u.window.zero_()
        u.window[:, :n] = idx[:, T - n :]
        u.count.fill_(n)
        rows = () if u.noise is None else u.noise.unbind(0)
        for done in range(0, max_new_tokens, self.chunk):
            wanted = min(self.chunk, max_new_tokens - done)
            # the draws of the characters wanted, in GPT.generate's order; a last, short chunk computes characters
            # past the end that nobody reads (their noise is stale), and the generator does not move
            for row in rows[:wanted]:
                row.exponential_(generator=generator)
            yield u(), wanted

    @torch.inference_mode()
    def _slide(self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None
               ) -> Iterator[torch.Tensor]:
        """generate_iter's eager path: the window is the last block_size characters as they are, padded while it fills
        to a multiple of SLIDE_ROWS rows (with a window pass, to block_size, the shape it takes), and the character is
        drawn as torch.multinomial draws it (as the fixed-shape step does too), so the generator moves alike."""
        block_size = self.model.config.block_size
        B, T = idx.shape
        context = torch.zeros(B, max(T + max_new_tokens + SLIDE_ROWS, block_size), dtype=idx.dtype, device=idx.device)
        context[:, :T] = idx
        positions = torch.arange(block_size, device=idx.device)  # the last character's row is a view of it
        count = torch.zeros(1, dtype=torch.long)  # the window pass's count of characters
        noise = torch.empty(B, self.model.config.vocab_size, device=idx.device)
        for end in range(T, T + max_new_tokens):
            start = max(0, end - block_size)
            if self.steps.pass_op is not None:
                x = self.steps.hidden(context[:, start : start + block_size], count.fill_(end - start))
            else:
                rows = min(block_size, -(-(end - start) // SLIDE_ROWS) * SLIDE_ROWS)
                last = positions[end - start - 1 : end - start]
                x = self.model.hidden_at(context[:, start : start + rows], last, self.first)
            logits = self.model.lm_head(x).float()  # (B, vocab)
            scaled = logits / (self.temperature or 1.0)
            # One check a character (scaled is finite where logits are), through the sum: finite only where every
            # value is (finite values whose sum overflows take the branch too, and come out of it as they were)
            if not math.isfinite(scaled.sum()):
                if not torch.isfinite(logits).all():
                    raise NonFiniteLogits()
                scaled = greedy_where_overflowed(scaled, logits)  # logits near float32's limit: as sample_next does
            if self.temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                # torch.multinomial's draw of one id as it makes it, the argmax of the probabilities over Exp(1) noise
                # from the generator, without its checks of probabilities that a softmax made (24 -> 10 us a
                # character, block 8, Zen 4)
                probs = filtered_probs(scaled, self.top_k, self.top_p, logits)
                next_id = probs.div_(noise.exponential_(generator=generator)).argmax(dim=-1, keepdim=True)  # (B, 1)
            context[:, end : end + 1] = next_id
            yield next_id


def characters(chunks: Iterator[tuple[torch.Tensor, int]]) -> Iterator[torch.Tensor]:
    """The characters (B, 1) of each chunk (its ids, how many were asked for), one at a time (checked_ids). The chunks
    are drawn in inference mode, the characters handed out outside it, as the caller's code between them runs: a
    generator that torch.inference_mode decorates enters and leaves it at every resume (about 1.3 us), so here once a
    chunk rather than once a character."""
    for ids, wanted in chunks:
        yield from checked_ids(ids, wanted)


def checked_ids(ids: torch.Tensor, wanted: int) -> Iterator[torch.Tensor]:
    """The first `wanted` characters (B, 1) of a chunk's ids (B, chunk), one at a time, up to the first at which a
    row's logits were not finite (-1, from WindowSteps.draw): there NonFiniteLogits, as GPT.generate raises it."""
    marks = (ids[:, :wanted] < 0).any(dim=0).tolist()  # one read of the chunk from the device, not one a character
    good = marks.index(True) if True in marks else wanted
    yield from ids.split(1, dim=1)[:good]  # one call for the chunk's views (a slice each: about 1 us more a character)
    if good < wanted:
        raise NonFiniteLogits()


class WindowSteps(nn.Module):
    """WindowSampler's step as a module: the model, the first block's looked-up projections (or None) and the sampling
    settings, so that compiled code can take all it reads as one argument (a step saved whole, training/step_file.py,
    is named by the settings and shapes of its arguments). Called, it draws up to ``chunk`` characters."""

    def __init__(self, model: GPT, first: torch.Tensor | None, temperature: float, top_k: int | None,
                 top_p: float | None, chunk: int, span: int = 1, window_pass: WindowPass | None = None) -> None:
        super().__init__()
        if span < 1 or chunk % span:
            raise ValueError(f"span must be a divisor of chunk ({chunk}), got {span}")
        if window_pass is not None and span != 1:
            raise ValueError("a window_pass draws one character a pass: span must be 1")
        self.model = model
        self.register_buffer("first", first, persistent=False)
        self.temperature, self.top_k, self.top_p, self.chunk, self.span = temperature, top_k, top_p, chunk, span
        # the window's pass as one operator, from the weights packed for it (a buffer: compiled code reads it as one)
        self.pass_op = None if window_pass is None else window_pass.op
        self.pass_source = "" if window_pass is None else window_pass.source  # a setting: keys a step saved whole
        self.register_buffer("pass_weights", None if window_pass is None else window_pass.weights, persistent=False)

    def forward(self, window: torch.Tensor, n: torch.Tensor, wanted: torch.Tensor, noise: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """window (B, block_size) ids holding n (a (1,) count, >= 1) characters; wanted (a (1,) count, 1..chunk)
        characters to draw, with noise (chunk, B, vocab) Exp(1), or None (greedy) -> (the next ids (B, chunk), of
        which the first `wanted` are drawn, the window after them, their count)."""
        drawn = torch.zeros(window.size(0), self.chunk, dtype=window.dtype, device=window.device)
        k = torch.zeros(1, dtype=torch.long, device=window.device)
        draw = self.draw if self.span == 1 else self.draw_span
        if not torch.compiler.is_compiling():
            for _ in range(-(-int(wanted) // self.span)):
                k, window, n, drawn = draw(k, window, n, drawn, noise)
            return drawn, window, n
        # Compiled: a loop in the graph, so its body (the forward pass) is compiled once, whatever the chunk. With a
        # span, a last, short chunk may draw characters past those wanted, which nobody reads (their noise is stale).
        _, window, n, drawn = while_loop(lambda k, *_: k[0] < wanted[0],
                                         lambda *state: draw(*state, noise), (k, window, n, drawn))
        return drawn, window, n

    def draw_span(self, k: torch.Tensor, window: torch.Tensor, n: torch.Tensor, drawn: torch.Tensor,
                  noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """draw for span characters, the known rows of their windows computed together (model.span)."""
        return draw_span(self.model, self.first, self.temperature, self.top_k, self.top_p, self.span, k, window, n,
                         drawn, noise)

    def hidden(self, window: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The final state (B, C) of position n - 1 of the window (B, block_size) holding n (a (1,) count)
        characters: GPT.hidden_at's, or the window pass's where the sampler has one."""
        if self.pass_op is None:
            return self.model.hidden_at(window, n - 1, self.first)
        cfg = self.model.config
        first = self.first if self.first is not None else self.pass_weights.new_empty(0)
        return self.pass_op(window, n, first, self.pass_weights, cfg.vocab_size, cfg.n_embd, cfg.n_head, cfg.n_layer,
                            cfg.bias)

    def draw(self, k: torch.Tensor, window: torch.Tensor, n: torch.Tensor, drawn: torch.Tensor,
             noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One character: the k-th of the chunk (k a (1,) index), drawn into column k of drawn (B, chunk), or -1
        there where the row's logits are not all finite numbers (see checked_ids)."""
        block_size = window.size(1)
        x = self.hidden(window, n)  # (B, C)
        logits = self.model.lm_head(x).float()  # (B, vocab)
        finite = torch.isfinite(logits).all(dim=-1, keepdim=True)  # (B, 1)
        if noise is None:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = filtered_probs(greedy_where_overflowed(logits / self.temperature, logits), self.top_k, self.top_p,
                                   logits)
            next_id = (probs / noise.index_select(0, k).squeeze(0)).argmax(dim=-1, keepdim=True)  # (B, 1)
        full = n == block_size
        # not full: write the character after the last one; full: slide by one and put it at the end
        placed = window.index_copy(1, n.clamp(max=block_size - 1), next_id)
        window = torch.where(full, torch.cat([window[:, 1:], next_id], dim=1), placed)
        return k + 1, window, n + (~full).long(), drawn.index_copy(1, k, torch.where(finite, next_id, -1))


def run_steps(steps: WindowSteps, window: torch.Tensor, n: torch.Tensor, wanted: torch.Tensor,
              noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """steps called on the rest: the function that WindowSampler's ``ahead`` compiles, the module an argument."""
    return steps(window, n, wanted, noise)
