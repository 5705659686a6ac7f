"""Sharding a model over a node's ranks with torch's FSDP2 (``fully_shard``, ZeRO-3): the compute side of a
sharded node.

``shard`` wraps each repeated block of a plain model (the entries of its ``nn.ModuleList``s: a GPT's
transformer blocks, an HF model's layers) and then the model itself, so that each rank keeps only its
rows of every parameter (FSDP2 cuts dim 0) and gathers a block's parameters just for its forward and
backward. The model does not know it is sharded. ``load`` writes full tensors into the ranks' shards,
``gathered`` reads them back one tensor at a time (for the codec, which never sees more than one full
tensor on a rank), and ``local_bytes`` is what a rank holds. ``ShardedReplica`` is a replica of the
ranks' shards: it replays updates on its rows and fingerprints the whole model with one collective.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from gradwire.optim.outer import UpdateRule
from gradwire.replica import Fingerprint, Replica, moments, takes_moments


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


def shard(model: nn.Module, *, device: torch.device | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """``model`` with its parameters sharded over the default process group (in place; returned for
    convenience). ``reshard_after_forward`` False keeps a block's gathered parameters until its backward
    (ZeRO-2-like: more memory, fewer all-gathers). A model built with ``meta.parameters_on_meta`` gets its
    shards allocated on ``device`` here, values undefined (``load`` fills them): no rank ever allocates a
    whole parameter."""
    for block in blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    if any(p.is_meta for p in model.parameters()):
        if device is None:
            raise ValueError("a model with parameters on the meta device needs a device to allocate its shards on")
        # FSDP2 takes the new local shards for its own (its module's _apply resets them); buffers keep their values
        model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
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
        # src_data_rank None: every rank cuts its rows from its own copy, no communication
        p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())


def gathered(model: nn.Module, what: str = "param") -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors, one at a time, on every rank: the parameters (``what`` "param") or their gradients
    ("grad", the node's mean gradient once backward has reduce-scattered it)."""
    for name, p in _sharded(model):
        t = p if what == "param" else p.grad
        if t is None:
            raise ValueError(f"parameter {name} has no gradient")
        yield name, t.full_tensor()


@torch.no_grad()
def gather_to(t: DTensor, rank: int) -> torch.Tensor | None:
    """The full tensor of a (dim-0 sharded) ``t`` on rank ``rank`` only, ``None`` elsewhere: a gather, in
    which every rank sends its rows once (an all-gather would send them to every rank). A collective."""
    local = t.to_local()
    world, me = t.device_mesh.size(), t.device_mesh.get_local_rank()
    rows = t.shape[0]
    per = -(-rows // world)  # FSDP2 cuts dim 0 like torch.chunk: equal chunks of ceil(rows / N), the last short
    padded = local.new_zeros((per, *t.shape[1:]))
    padded[: local.shape[0]] = local
    chunks = [torch.empty_like(padded) for _ in range(world)] if me == rank else None
    dist.gather(padded, chunks, dst=rank, group=t.device_mesh.get_group())
    return torch.cat(chunks)[:rows] if chunks is not None else None


def local_bytes(model: nn.Module, what: str = "param") -> int:
    """The bytes of this rank's shards of the parameters (or of their gradients)."""
    total = 0
    for _, p in _sharded(model):
        t = p if what == "param" else p.grad
        if t is not None:
            local = t.to_local()
            total += local.numel() * local.element_size()
    return total


class ShardedReplica(Replica):
    """A replica whose parameters (and outer momentum) are the rank's FSDP2 shards of an already ``shard``ed
    model. The same interface as ``Replica``: an update is decoded in full (every rank alike), then each rank
    steps its own rows; the fingerprint is the whole replica's, summed over the ranks. Every rank must make
    the same calls in the same order: ``fingerprint`` and ``load_state`` are collectives or follow them."""

    def __init__(self, model: nn.Module, rule: UpdateRule, version: int = 0) -> None:
        super().__init__(model, rule, version)
        self._sharded = dict(_sharded(model))  # checks that every parameter is sharded

    def _step_tensors(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self._sharded.values()]  # the shards themselves: steps write into them

    def _share(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return _rows(full, self._sharded[name])

    def fingerprint(self, with_moments: bool | None = None) -> Fingerprint:
        """The whole replica's fingerprint (as ``replica.fingerprint`` of the full tensors), a collective: every
        rank asks for the same (an order's, or the version's: ``takes_moments``)."""
        if with_moments is None:
            with_moments = takes_moments(self.version, self.moments_every)
        return self.fingerprint_of(self._sharded, with_moments)

    @torch.no_grad()
    def fingerprint_of(self, tensors: Mapping[str, torch.Tensor], with_moments: bool = True) -> Fingerprint:
        """The fingerprint of whole tensors sharded as the parameters are (DTensors: the parameters, or their
        gradients), a collective: per-tensor sums and sums of squares of the shards (unless ``with_moments`` is
        false), and each sampled value from the rank that has it."""
        sums, sumsqs, samples = [], [], []
        for name, positions in zip(self._sharded, self._positions):
            p = tensors[name]
            assert isinstance(p, DTensor), f"{name}: a sharded replica fingerprints sharded tensors"
            local = p.to_local().reshape(-1)
            total, squares = moments(local) if with_moments else (local.new_zeros((), dtype=torch.float64),) * 2
            sums.append(total)
            sumsqs.append(squares)
            first = _first_row(p) * (p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1)
            mine = (positions >= first) & (positions < first + local.numel())
            values = torch.zeros(len(positions), dtype=torch.float64, device=local.device)
            values[mine.to(local.device)] = local[(positions[mine] - first).to(local.device)].double()
            samples.append(values)
        stats = torch.cat([torch.stack(sums), torch.stack(sumsqs), *samples])
        dist.all_reduce(stats)  # one collective for the whole fingerprint
        found = Fingerprint.from_stats(stats, len(sums))
        return found if with_moments else found.samples_only()


def _first_row(p: DTensor) -> int:
    """The first row of the full tensor that this rank's shard holds (FSDP2 cuts dim 0 like torch.chunk)."""
    rows = p.shape[0] if p.dim() else 1
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    per = -(-rows // world)  # ceil
    return min(rank * per, rows)


def _rows(full: torch.Tensor, p: DTensor) -> torch.Tensor:
    """This rank's rows of a full tensor shaped like ``p``."""
    first, local = _first_row(p), p.to_local()
    return full.to(local.device, local.dtype).reshape(p.shape)[first : first + local.shape[0]].clone()
