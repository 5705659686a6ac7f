"""Counting what a rank puts on its node's bus when torch's own parallelism issues the collectives.

DDP's traffic is counted by its communication hook (``worker.hooks``) and local-SGD's by ``NodeGroup``;
FSDP2's all-gathers and reduce-scatters and a pipeline's activation sends are issued inside torch, out of
reach of either. ``CollectiveBytes`` is a dispatch mode that sees every c10d operation the thread that
entered it issues (its backward too) and counts the bytes of each by the same rule as the hooks: the size
of the collective's full tensor (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor),
or of what this rank sends (a send, its part of a gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - see below
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# torch imports torch._dynamo the first time an op reaches a Python dispatch mode, and something that import
# keeps holds the frames of that call for the life of the process: under ``CollectiveBytes`` that is a
# round's stack, with every tensor its frames refer to (gradients, a codec group's coefficients). Imported
# above, with this module, it holds nothing of ours.

_c10d, _functional = torch.ops.c10d, torch.ops._c10d_functional

# Which argument is the collective's full tensor (or list of tensors): an index, or "out" for the result.
_FULL: dict[Any, int | str] = {
    _c10d._allgather_base_: 0,
    _c10d.allgather_: 0,
    _c10d._reduce_scatter_base_: 1,
    _c10d.reduce_scatter_: 1,
    _c10d.allreduce_: 0,
    _c10d.broadcast_: 0,
    _c10d.send: 0,
    _c10d.gather_: 1,  # what this rank sends (the rows it holds); the receiver counts its own part too
    _functional.all_gather_into_tensor: "out",
    _functional.reduce_scatter_tensor: 0,
    _functional.all_reduce: 0,
}


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, Sequence):
        return sum(_nbytes(t) for t in tensors)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """``with CollectiveBytes() as bus: ...``: ``bus.bytes`` and ``bus.calls`` of the collectives issued."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers itself to plain collectives first; those come back here
        out = func(*args, **(kwargs or {}))
        where = _FULL.get(func._overloadpacket)
        if where is not None:
            self.bytes += _nbytes(out if where == "out" else args[where])
            self.calls += 1
        return out
