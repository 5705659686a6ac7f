"""Sharding a model over a node's ranks with torch's FSDP2 (``fully_shard``, ZeRO-3): the compute side of a
sharded node.

``shard`` wraps each repeated block of a plain model (the entries of its ``nn.ModuleList``s: a GPT's
transformer blocks, an HF model's layers) and then the model itself, so that each rank keeps only its
rows of every parameter (FSDP2 cuts dim 0) and gathers a block's parameters just for its forward and
backward. The model does not know it is sharded. ``load`` writes full tensors into the ranks' shards,
``gathered`` reads them back one tensor at a time (for the codec, which never sees more than one full
tensor on a rank), and ``local_bytes`` is what a rank holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the children of its outermost ``nn.ModuleList``s (lists inside a block,
    such as a mixture's experts, stay in their block's unit)."""
    found: list[nn.Module] = []
    inside: set[int] = set()  # every module within a block found so far
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            for child in module:
                found.append(child)
                inside.update(id(m) for m in child.modules())
    return found


def shard(model: nn.Module, *, reshard_after_forward: bool = True) -> nn.Module:
    """``model`` with its parameters sharded over the default process group (in place; returned for
    convenience). ``reshard_after_forward`` False keeps a block's gathered parameters until its backward
    (ZeRO-2-like: more memory, fewer all-gathers)."""
    for block in blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def _sharded(model: nn.Module) -> Iterator[tuple[str, DTensor]]:
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise TypeError(f"parameter {name} is not sharded: call fsdp.shard first")
        yield name, p


@torch.no_grad()
def load(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write full tensors (every rank passes the same) into each rank's shard of the parameters."""
    for name, p in _sharded(model):
        full = tensors[name].to(p.device_mesh.device_type, p.dtype)
        p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())


def gathered(model: nn.Module, what: str = "param") -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors, one at a time, on every rank: the parameters (``what`` "param") or their gradients
    ("grad", the node's mean gradient once backward has reduce-scattered it)."""
    for name, p in _sharded(model):
        t = p if what == "param" else p.grad
        if t is None:
            raise ValueError(f"parameter {name} has no gradient")
        yield name, t.full_tensor()


def local_bytes(model: nn.Module, what: str = "param") -> int:
    """The bytes of this rank's shards of the parameters (or of their gradients)."""
    total = 0
    for _, p in _sharded(model):
        t = p if what == "param" else p.grad
        if t is not None:
            local = t.to_local()
            total += local.numel() * local.element_size()
    return total
