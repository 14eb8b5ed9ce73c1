"""Memory a run needs, estimated from its config before anything is allocated, and the check that refuses a run that
cannot fit in one line instead of leaving it to the allocator or the kernel's OOM killer."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from model import GPTConfig, build_model

from .errors import UsageError

# Estimates count float32 (4 bytes) for every float: autocast keeps master weights, gradients and optimizer state in
# float32 and halves only some activations, so this errs on the side of a run that fits.
FLOAT = 4
ID = 8  # token ids are int64 once batched


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a run (training, or sampling) needs at its peak, by part."""

    weights: int  # parameters, their gradients and AdamW's two moments
    masks: int  # the causal mask each layer keeps (block_size x block_size floats: model.attention.causal_bias)
    activations: int  # what one micro-batch's forward keeps for backward, or one evaluation pass, the larger
    text: int = 0  # sampling: the ids of the prompt and of the characters asked for (see text_bytes)

    @property
    def total(self) -> int:
        return self.weights + self.masks + self.activations + self.text

    def dominant(self) -> str:
        """The name of the largest part."""
        return max(("weights", "masks", "activations", "text"), key=lambda name: getattr(self, name))

    def largest(self) -> str:
        """What to change to need less, for the part that dominates."""
        parts = {
            "weights": "a smaller model (model.n_layer, model.n_embd)",  # or, for a checkpoint, another one
            "masks": "a smaller model.block_size",
            # every layer keeps its activations for the backward pass: depth counts as the batch does
            "activations": "a smaller train.batch_size (train.grad_accum_steps keeps the batch per step), "
                           "model.block_size or model.n_layer",
            "text": "fewer --num-samples or a smaller --max-new-tokens",
        }
        return parts[self.dominant()]


def parameter_count(cfg: GPTConfig) -> int:
    """Parameters of the model cfg describes, counted without allocating them: from the config for a GPT (the head
    shares the token embedding), on the meta device for the other types."""
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    if cfg.type != "gpt":
        # Built on the meta device, but layer by layer: counted for at most three layers, and on from there by the
        # third layer's count (every layer after the first is alike), so that n_layer=10**8 takes no time either.
        def built(layers: int) -> int:
            with torch.device("meta"):
                return sum(p.numel() for p in build_model(replace(cfg, n_layer=layers)).parameters())

        if L <= 3:
            return built(L)
        return built(3) + (L - 3) * (built(3) - built(2))
    bias = 1 if cfg.bias else 0
    # q/k/v and projection, MLP in and out; their 9C biases and the two layer norms' 2C biases; the norms' weights
    per_layer = 12 * C * C + bias * 11 * C + 2 * C
    if cfg.score == "additive":
        hs = cfg.head_size
        per_layer += 2 * hs * hs + hs
    last_norm = C + bias * C if cfg.norm == "pre" else 0  # post-norm models have none (GPT.transformer.ln_f)
    return L * per_layer + V * C + T * C + last_norm


def activation_bytes(cfg: GPTConfig, sequences: int, *, backward: bool, device: torch.device | None = None) -> int:
    """Bytes of activations for a forward pass over `sequences` windows of block_size: with backward, what every
    layer keeps for it (and one layer's gradients besides); without (evaluation), what one layer holds at once.
    device: where it runs (None: counted as off CUDA, the larger)."""
    C, L, V, T, nh = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size, cfg.n_head
    if cfg.type == "bigram":  # its table gives the logits: no layers, attention or embeddings (it was counted as a
        return sequences * T * (5 * V * FLOAT + 6 * ID)  # GPT: refused at 211.8 GB what ran in 0.4)
    # PyTorch's fused kernels take dropout on CUDA alone: elsewhere scaled_dot_product_attention with dropout_p > 0
    # runs its math path, which keeps the scores, their softmax, the dropout mask and the dropped weights as the manual
    # path does (shakespeare_char.yaml's model, batch 16, eager float32 on a CPU: 1.51 GB of activations at the peak
    # with dropout 0.2 and 0.74 with none, where 0.86 was counted for both; manual attention with dropout, 1.53)
    math_dropout = backward and cfg.dropout > 0 and (device is None or device.type != "cuda")
    manual = cfg.attention == "manual" or math_dropout
    scores = 3 * nh * T if manual else nh  # scores, masked scores, softmax; the fused kernel none
    if cfg.score == "additive":
        scores += 2 * T * C  # the (T, T, head_size) tanh hidden of every head, and its input
    if cfg.dropout > 0 and manual:
        scores += 2 * nh * T
    # embeddings; the logits, their log-softmax, the gradients of both and one more copy that the head's backward
    # makes (a vocabulary of 1,112,032 characters on tiny.yaml's model, batch 16, 32 and 64, peaked at 3.78, 6.01 and
    # 10.46 GB, about 3.9 vocabulary-wide floats a position, where 3 were counted: 3.42, 5.13 and 8.56 GB); ids
    ends = (3 * C + 5 * V) * FLOAT + 6 * ID
    if backward:  # norms, q/k/v, attention output, projections, the 4x MLP, residuals: kept by every layer
        per_token = (L + 1) * (19 * C + scores) * FLOAT + ends
    else:  # a layer's input, q/k/v, scores and the 4x MLP, freed as the next layer starts
        per_token = (10 * C + scores) * FLOAT + ends
    return sequences * T * per_token


def mask_bytes(cfg: GPTConfig) -> int:
    """Bytes of the causal masks a model of cfg keeps: one block_size x block_size float bias a layer."""
    return cfg.n_layer * cfg.block_size * cfg.block_size * FLOAT if cfg.type == "gpt" else 0


def training_need(cfg: GPTConfig, batch_size: int, eval_sequences: int, averaged: bool = False,
                  device: torch.device | None = None) -> MemoryNeed:
    """The peak of a training run of model cfg (vocab_size set) on device with micro-batches of batch_size sequences
    and evaluation passes of eval_sequences; averaged: it keeps the weights' moving average too (train.ema_decay), and
    while it evaluates that, a copy of the weights."""
    return MemoryNeed(
        weights=(6 if averaged else 4) * parameter_count(cfg) * FLOAT,
        masks=mask_bytes(cfg),
        activations=max(activation_bytes(cfg, batch_size, backward=True, device=device),
                        activation_bytes(cfg, eval_sequences, backward=False, device=device)),
    )


def vocabulary_advice(cfg: GPTConfig, need: MemoryNeed, small: MemoryNeed) -> str | None:
    """check_fits's advice where the vocabulary makes most of need (small: the same run with two characters): a
    bigram model's vocabulary x vocabulary table, or the logits of a text of very many characters. The default advice
    named model.n_layer and model.n_embd there, which cannot help a bigram table."""
    if need.total <= 2 * small.total:
        return None
    return (f"use a smaller vocabulary (data.max_vocab=N keeps the N most frequent characters; this one has "
            f"{cfg.vocab_size:,})")


def model_need(cfg: GPTConfig, sequences: int = 1, text: int = 0) -> MemoryNeed:
    """The peak of building model cfg and sampling `sequences` streams from it (sample.py, or checking a checkpoint
    before a resume): the weights, the masks, the KV cache and one window's forward pass, and `text` bytes of the
    text's ids (text_bytes)."""
    kv_cache = 2 * cfg.n_layer * sequences * cfg.block_size * cfg.n_embd * FLOAT
    return MemoryNeed(
        weights=parameter_count(cfg) * FLOAT,
        masks=mask_bytes(cfg),
        activations=kv_cache + activation_bytes(cfg, sequences, backward=False),
        text=text,
    )


# sample.py keeps the id of every character it generates until the samples are written (4-byte ints in an array a
# sample, and the room such an array keeps to grow), and its plain paths (GPT.generate: --no-cache, the other model
# types) hold the prompt and the new characters of every sample as one tensor of int64 ids on the device.
KEPT_ID = 5


def text_bytes(sequences: int, prompt_chars: int, new_tokens: int) -> tuple[int, int]:
    """(bytes on the sampling device, bytes in the CPU's memory) of the text of `sequences` samples of new_tokens
    characters after a prompt of prompt_chars: the plain paths' context, and the ids kept until they are written."""
    return sequences * (prompt_chars + new_tokens) * ID, sequences * new_tokens * KEPT_ID


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """What the cgroup (a container's memory limit) still allows, where there is one."""
    folder = Path("/sys/fs/cgroup")
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def process_limit_available() -> int | None:
    """What this process's own limits (ulimit -v, ulimit -d) still let it allocate: RLIMIT_AS less the address space
    it has mapped, RLIMIT_DATA less its data segment, the smaller; None where neither is set. A run past them fails
    in the allocator with a traceback, however much the machine has free."""
    try:
        import resource

        with open("/proc/self/status", encoding="ascii") as f:
            used = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                    if k in ("VmSize", "VmData")}
        left = []
        for limit, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
            soft = resource.getrlimit(limit)[0]
            if soft != resource.RLIM_INFINITY:
                left.append(max(soft - used[field], 0))
    except (ImportError, OSError, ValueError, IndexError, KeyError):
        return None
    return min(left) if left else None


def available_bytes(device: torch.device) -> int | None:
    """Memory the machine (or its container) has free for a new allocation on device, or None where it cannot be
    told. What one process may take is less where its own limit is lower: allocatable_bytes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    known = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    if not known and hasattr(os, "sysconf"):
        try:
            known.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            pass
    return min(known) if known else None


def allocatable_bytes(device: torch.device) -> int | None:
    """What this process may still allocate on device: what the machine has free, or less under its own limit."""
    known = [n for n in (available_bytes(device), process_limit_available() if device.type == "cpu" else None)
             if n is not None]
    return min(known) if known else None


# What a refusal says of the memory that is short, where it is the process's limit rather than the machine's
LIMITED = "this process's memory limit (ulimit -v or -d) leaves"


def whose_memory(device: torch.device, free: int) -> str:
    """How a refusal names where free bytes (allocatable_bytes) were counted: 'this machine has', or LIMITED where
    the process's own limit is what leaves that little."""
    limit = process_limit_available() if device.type == "cpu" else None
    if limit is not None and limit <= free:
        return LIMITED
    return "this machine has" if device.type == "cpu" else f"{device} has"


# A need past this many bytes (a million petabytes) is said as "more than" it: a config of 10**400 layers needs a
# number no one reads, and one too large to be a float.
SHOWN_MAX_BYTES = 10**24


def _gb(n: int, near: int | None = None) -> str:
    """n bytes as '12.3 GB' or '456 MB', counted in integers (a float would overflow past about 1.8e308); in MB
    where near (the amount it is compared with) would read the same ('needs about 1.9 GB ... 1.9 GB free')."""
    n = int(n)
    if near is not None and n != near and _gb(n) == _gb(near):
        return f"{(n + 500_000) // 10**6:,} MB"
    if n >= 10**8:
        tenths = (n + 5 * 10**7) // 10**8
        return f"{tenths // 10:,}.{tenths % 10} GB"
    return f"{(n + 500_000) // 10**6:,} MB"


def check_fits(need: MemoryNeed, device: torch.device, processes: int = 1, *, what: str = "this run",
               advice: str | None = None) -> None:
    """UsageError, in one line, when `processes` runs of this need cannot fit in what device has free. what names
    the work ('this run', 'loading checkpoint x'); advice replaces the default advice (the part to make smaller)."""
    free = available_bytes(device)
    total = need.total * processes
    if free is not None and total > free:
        if processes > 1 and total <= SHOWN_MAX_BYTES:
            who = f"about {processes} processes x {_gb(need.total)}"
        else:
            who = _about(total, free)
        where = "this machine has" if device.type == "cpu" else f"{device} has"
        raise UsageError(f"{what} needs {who} of memory and {where} {_gb(free, total)} free; "
                         f"{advice or 'use ' + need.largest()}")
    limit = process_limit_available() if device.type == "cpu" else None
    if limit is not None and need.total > limit:
        # The machine has room, but each process's own limit (ulimit -v or -d) is lower: the allocator would fail.
        each = " a process" if processes > 1 else ""
        machine = f" (the machine has {_gb(free)} free)" if free is not None else ""
        raise UsageError(f"{what} needs {_about(need.total, limit)}{each} of memory and {LIMITED} "
                         f"{_gb(limit, need.total)}; raise the "
                         f"limit in the shell that starts it{machine}")


def _about(n: int, near: int | None = None) -> str:
    """n bytes in words, past SHOWN_MAX_BYTES as 'more than' it (near: as for _gb)."""
    return f"more than {_gb(SHOWN_MAX_BYTES)}" if n > SHOWN_MAX_BYTES else f"about {_gb(n, near)}"
