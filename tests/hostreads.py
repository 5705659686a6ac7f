"""Which torch calls a piece of code makes, by name: on a GPU each host read (``Tensor.cpu``, ``item``,
``tolist``, a tensor's truth value, ``nonzero``) waits for the device to finish what was queued, so a path
that reads once a tensor or once a part costs that many round trips. A CPU run cannot time them; it can
count them.

    with Calls(HOST_READS) as calls:
        replica.apply(update)
    assert calls.names.count("cpu") == 1
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset({"cpu", "item", "tolist", "__bool__", "nonzero", "numpy"})


class Calls(TorchFunctionMode):
    """Records, in order, the names of the torch functions and tensor methods in ``names`` called under it
    (on the thread that entered it), and in ``sources`` the device type of each call's first argument where
    it is a tensor (a copy's source: ``"cpu"`` for an upload)."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self.watched = frozenset(names)
        self.names: list[str] = []
        self.sources: list[str | None] = []

    def uploads(self) -> int:
        """The ``to`` calls made on host tensors (under a device other than the host's: its copies)."""
        return sum(1 for n, s in zip(self.names, self.sources) if n == "to" and s == "cpu")

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        name = getattr(func, "__name__", "")
        if name in self.watched:
            self.names.append(name)
            self.sources.append(args[0].device.type if args and isinstance(args[0], torch.Tensor) else None)
        return func(*args, **(kwargs or {}))
