"""Token ids to training data: the train/validation split and random batches of next-character windows."""

from __future__ import annotations

import torch

from .corpus import DataError

# Ids wider than a byte are stored unsigned (uint16, uint32) but gathered through a signed view of the same bits:
# indexing int16/int32 works on every torch device, uint16/uint32 only on some. The mask after widening to int64
# gives back ids above 32767 (2**31 - 1) that the signed view reads as negative.
_SIGNED_VIEW = {torch.uint16: (torch.int16, 0xFFFF), torch.uint32: (torch.int32, 0xFFFFFFFF)}


def split_ids(ids: torch.Tensor, val_fraction: float, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last val_fraction of ids (rounded) is validation, the rest training.

    Both are views of ids. Each must hold one training window (block_size + 1 ids), else DataError.
    """
    if ids.dim() != 1:
        raise ValueError(f"split_ids needs a 1-D tensor of ids, got shape {tuple(ids.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    n = ids.size(0)
    n_val = round(n * val_fraction)
    n_train = n - n_val
    if min(n_train, n_val) < block_size + 1:
        raise DataError(
            f"the text is too short for block_size {block_size} with val_fraction {val_fraction} "
            f"({n} characters: {n_train} to train on, {n_val} to validate, each needs at least "
            f"{block_size + 1}); use a longer text, a smaller model.block_size or a different "
            f"data.val_fraction"
        )
    return ids[:n_train], ids[n_train:]


def get_batch(
    data: torch.Tensor,
    block_size: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size random windows of data: inputs x and next-character targets y, both int64 (B, T) on device.

    data is a 1-D tensor of ids of any integer dtype: int64, or the uint8/uint16/uint32 of a memory-mapped corpus,
    of which only the windows drawn are read. The starts come from generator alone, so the same generator state
    gives the same batch (exact resume).
    """
    n_starts = data.size(0) - block_size
    if n_starts < 1:
        raise ValueError(f"get_batch needs more than block_size = {block_size} ids, got {data.size(0)}")
    starts = torch.randint(n_starts, (batch_size,), generator=generator)  # (B,)
    # Built afresh each call: caching it saved about 1 us of a 15-40 us call when measured, not worth module state.
    offsets = torch.arange(block_size + 1, device=data.device)  # (T+1,)
    # One gather of B windows of T+1 ids; x and y are two overlapping views of it, so each id is copied and moved
    # to the device once instead of twice.
    signed, mask = _SIGNED_VIEW.get(data.dtype, (None, 0))
    source = data if signed is None else data.view(signed)
    windows = source[starts.to(data.device)[:, None] + offsets]  # (B, T+1)
    windows = windows.to(torch.int64)
    if mask:
        windows &= mask  # in place on the int64 copy that .to just made
    device = torch.device(device)
    if device.type == "cuda" and windows.device.type == "cpu":
        # Pinned memory lets the copy run asynchronously and overlap the previous step's GPU work.
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)
    # Contiguous copies rather than views: a view of windows cannot be .view()-ed, which code written in the
    # nanoGPT style does to targets; the copies cost a few microseconds, next to milliseconds for a step.
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)
