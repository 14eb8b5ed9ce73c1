"""Python's cyclic garbage collector, paused while train.py and sample.py start.

Starting, a process makes some 260,000 objects that live as long as it does (torch's modules; 600,000 with the
compiler's: dynamo's, inductor's, sympy's, networkx's), and next to no cyclic garbage. The collector still scans them
all each time they have grown by a quarter. Measured on a 2-core Zen 4 EPYC (torch 2.13, 2026-12-07), the CPU config
for 20 steps (AdamW, float32): an eager train.py spent 0.28 s collecting, one whose step loads from the compile cache
0.68 s (six full collections, each finding 0 to 10 objects to free), sample.py (500 characters) 0.11 s. Paused as
below, whole processes took (six rounds in turns, medians and ranges): eager runs 3.57 s (3.01-4.22) -> 2.77
(2.58-3.13), runs with the step loaded whole 6.23 (5.83-7.61) -> 4.56 (4.35-5.70), sample.py 2.36 (2.28-2.91) ->
2.30 (1.80-2.42); first runs that compile the step 27.6 and 28.3 s -> 28.4 and 26.5. The peak memory rose by 3-10 MB
(the start's garbage kept).

So train.py and sample.py, run as programs, pause the collector before they import torch (pause), and take it up
again (resume) once the compiler's modules have loaded, where they compile (compile_cache.prepare_compile), else
where the work begins (the training loop, the first character): what the start made and still holds is moved out of
the collector's sight for good (``gc.freeze``), never scanned again, and the collector runs as usual on whatever comes
after. A compile itself makes cyclic garbage (its graphs), so it is not paused: kept paused through the cold compile
of configs/shakespeare_char.yaml's step (4 micro-batches), the process peaked at 1,957 MB against 1,569. A process
that calls their main functions (a test, a notebook) has nothing paused and nothing frozen. Imports no torch."""

from __future__ import annotations

import gc

_paused = False  # by pause, in this process, and not resumed since


def pause() -> None:
    """Stop collecting cyclic garbage until resume; called by train.py and sample.py as programs, first thing."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Where the run's work begins: what the start made is frozen and the collector runs again, if pause stopped it;
    else nothing."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
