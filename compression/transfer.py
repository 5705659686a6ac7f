"""Host tensors to a device in one copy a dtype.

On a GPU a copy from pageable host memory that is not ``non_blocking`` waits for the device to finish all it
was given (torch synchronizes the stream after it): a decode that copies each of a payload's tensors alone
stalls the device as many times, and a thread that decodes while another computes (the worker's look-ahead)
drains the compute's queue each time. Joined by dtype, a payload's tensors cost a copy or two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """``tensors`` on ``device``, each its own shape and dtype: those there already as they are, the others
    views of one copy a dtype."""
    device = torch.device(device)
    out = list(tensors)
    away = [i for i, t in enumerate(out) if t.device != device]
    if away:
        for i, t in zip(away, joined([out[i] for i in away], lambda flat: flat.to(device))):
            out[i] = t
    return out


def joined(tensors: Sequence[torch.Tensor], move: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` through ``move`` a dtype at a time: the tensors of each dtype joined flat, ``move`` called
    once on them, its result split back into views shaped as they were."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for members in by_dtype.values():
        moved = move(torch.cat([tensors[i].reshape(-1) for i in members]))
        for i, part in zip(members, moved.split([tensors[i].numel() for i in members])):
            out[i] = part.view(tensors[i].shape)
    return out  # type: ignore[return-value]
