"""What only a multi-GPU node needs, loaded only there.

torch's sharding and pipelining stacks (``torch.distributed.tensor``, ``fsdp``, ``pipelining``, which bring
``torch._dynamo``) take about two seconds of CPU to import, in every worker process; a single-device worker
never holds one of their objects. So the worker's modules import ``worker.fsdp``, ``worker.pipeline`` and
``worker.bus`` where a node uses them, and a node's engine loads them all as it starts (``for_nodes``),
before any call: ``worker.bus`` must be imported outside every round's stack (see there). Type checks go
through ``is_dtensor`` and ``is_instance``, which import nothing: no object is a DTensor, or a pipeline
runner, before its module is loaded.
"""

from __future__ import annotations

import importlib
import sys

NODE_MODULES = ("gradwire.worker.bus", "gradwire.worker.fsdp", "gradwire.worker.pipeline")


def for_nodes() -> None:
    """Load what a node's ranks use (a node's engine calls it as it starts)."""
    for name in NODE_MODULES:
        importlib.import_module(name)


def is_instance(obj: object, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` where ``module`` is loaded; ``False`` (without loading it) where not."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


def is_dtensor(obj: object) -> bool:
    return is_instance(obj, "torch.distributed.tensor", "DTensor")
