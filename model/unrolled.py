"""The CUDA graph path of model.sampler.WindowSampler (graph=True): a chunk of characters drawn from buffers that stay
on the device, replayed as one CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import GPTConfig


class Unrolled:
    """``chunk`` characters of ``batch`` rows per call, unrolled: ``draw`` (WindowSteps.draw, compiled or not)
    ``chunk`` times on a window and a count that stay in these buffers between calls, with the noise of each
    character put into ``noise`` by the caller beforehand. On CUDA, ``capture`` records the whole chunk once as a
    CUDA graph; each call then replays it, one launch instead of one per kernel, and returns a copy of its output
    (the graph overwrites it at the next call). Uncaptured, each call runs the same code eagerly."""

    def __init__(self, draw: Callable[..., tuple[torch.Tensor, ...]], chunk: int, batch: int, config: GPTConfig,
                 device: torch.device, sampled: bool) -> None:
        self.draw, self.chunk = draw, chunk
        self.window = torch.zeros(batch, config.block_size, dtype=torch.long, device=device)
        self.count = torch.ones(1, dtype=torch.long, device=device)
        self.noise = torch.ones(chunk, batch, config.vocab_size, device=device) if sampled else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream: torch.cuda.Stream | None = None  # the graph's own capture stream
        self.drawn: torch.Tensor | None = None

    def run(self) -> torch.Tensor:
        """The chunk's ids (batch, chunk); the window and count move on past them."""
        window, count = self.window, self.count
        k = torch.zeros(1, dtype=torch.long, device=window.device)
        drawn = torch.zeros(window.size(0), self.chunk, dtype=window.dtype, device=window.device)
        for _ in range(self.chunk):
            k, window, count, drawn = self.draw(k, window, count, drawn, self.noise)
        self.window.copy_(window)
        self.count.copy_(count)
        return drawn

    def capture(self) -> None:
        """Record run() as a CUDA graph. Its first runs happen outside the graph, on a side stream as CUDA graphs
        ask, so that what runs once (torch.compile's compiling, cuBLAS's workspace) is done before the capture; they
        move the window, which the caller sets before each text. The capture is on that stream too, not on the one
        that torch.cuda.graph shares among all its captures: cuBLAS keeps a workspace per stream, which the graph
        records, and freeing any graph captured on a stream frees that stream's workspace (PyTorch issue #193402),
        so two samplers sharing a stream could leave the later one writing into freed memory."""
        device = self.window.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self.drawn = self.run()
        self.graph, self.stream = graph, side

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.drawn.clone()
