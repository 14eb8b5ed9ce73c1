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

    data is a 1-D tensor of ids of any integer dtype: int64, or the uint8/uint16/uint32 of a cached corpus,
    of which only the windows drawn are read. The starts come from generator alone, so the same generator state
    gives the same batch (exact resume).
    """
    n_starts = data.size(0) - block_size
    if n_starts < 1:
        raise ValueError(f"get_batch needs more than block_size = {block_size} ids, got {data.size(0)}")
    starts = torch.randint(n_starts, (batch_size,), generator=generator)  # (B,)
    # One gather of B windows of T+1 ids, rows of the (n - T, T+1) view of every window (no copy: unfold), so that each
    # id is read, widened and moved to the device once.
    signed, mask = _SIGNED_VIEW.get(data.dtype, (None, 0))
    source = data if signed is None else data.view(signed)
    windows = source.unfold(0, block_size + 1, 1)[starts.to(data.device)]  # (B, T+1)
    windows = windows.to(torch.int64)
    if mask:
        windows &= mask  # in place on the int64 copy that .to just made
    device = torch.device(device)
    if device.type == "cuda" and windows.device.type == "cpu":
        # Pinned memory lets the copy run asynchronously and overlap the previous step's GPU work.
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)
    # x and y: the windows' first and last T ids, copied by one operator into one (2, B, T) buffer whose halves are
    # contiguous, so that they can be .view()-ed (as code written in the nanoGPT style does to targets). With the
    # unfolded gather above: the whole call 109-115 -> 83-94 us (2-core Zen 1 EPYC, B=32 T=8, uint8 ids).
    x, y = windows.unfold(1, block_size, 1).transpose(0, 1).contiguous()
    return x, y  # (B, T), (B, T)
