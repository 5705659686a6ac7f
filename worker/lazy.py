"""What only a multi-GPU node needs, loaded only there.

torch's sharding and pipelining stacks (``torch.distributed.tensor``, ``fsdp``, ``pipelining``, which bring
``torch._dynamo``) take about two seconds of CPU to import, in every worker process; a single-device worker
never holds one of their objects. So the worker's modules import ``worker.fsdp``, ``worker.pipeline`` and
``worker.bus`` where a node uses them, and a node's engine loads them all (``for_nodes``) as it places a
run that needs them (``fsdp`` or ``pipeline`` mode), before that run's first call. A DDP or local-SGD node's
ranks never load them. ``worker.bus`` must be imported outside every call's stack (see there): they load on
a thread of their own. Type checks go through ``is_dtensor`` and ``is_instance``, which import nothing: no
object is a DTensor, or a pipeline runner, before its module is loaded.
"""

from __future__ import annotations

import importlib
import sys
import threading

NODE_MODULES = ("gradwire.worker.bus", "gradwire.worker.fsdp", "gradwire.worker.pipeline")


def for_nodes() -> None:
    """Load what a sharded, ZeRO or pipelined node's ranks use, on a thread whose stack holds nothing of the
    caller's (``torch._dynamo``, which they bring, keeps the frames it was first imported under)."""
    if all(name in sys.modules for name in NODE_MODULES):
        return
    failed: list[BaseException] = []

    def load() -> None:
        try:
            for name in NODE_MODULES:
                importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            failed.append(e)

    loader = threading.Thread(target=load, name="gradwire-node-modules")
    loader.start()
    loader.join()
    if failed:
        raise failed[0]


def is_instance(obj: object, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` where ``module`` is loaded; ``False`` (without loading it) where not."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


def is_dtensor(obj: object) -> bool:
    return is_instance(obj, "torch.distributed.tensor", "DTensor")
