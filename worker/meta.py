"""Building a model one parameter's memory at a time: its parameters on the meta device as they are
registered, its buffers real. A replica then allocates each parameter as a push brings it
(``gradwire.replica``), and a sharded node allocates only a rank's shards (``worker.fsdp.shard``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from gradwire.models.meta import no_meta_writes

_REGISTER = nn.Module.register_parameter
_meta = threading.local()  # which threads are inside ``parameters_on_meta``
_patch_lock = threading.Lock()
_patched = 0


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if getattr(_meta, "inside", False) and isinstance(param, nn.Parameter) and not param.is_meta:
        param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    _REGISTER(module, name, param)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within this block (on this thread), a module's parameters move to the meta device as they are
    registered, its buffers stay real (what a model derives from its config: RoPE tables): a model is built
    one parameter's memory at a time, never whole, and ``shard`` allocates only a rank's shards. Ties made
    by assigning one parameter to two modules stay ties."""
    global _patched
    with _patch_lock:
        if not _patched:
            nn.Module.register_parameter = _register_on_meta
        _patched += 1
    _meta.inside = True
    try:
        with no_meta_writes():  # the parameters' initializers: nothing to write on the meta device
            yield
    finally:
        _meta.inside = False
        with _patch_lock:
            _patched -= 1
            if not _patched:
                nn.Module.register_parameter = _REGISTER


def buffers_to(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with its buffers moved to ``device`` and its parameters left where they are (a model whose
    parameters are on the meta device cannot take ``.to``)."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
    return model
