"""Count sketches of named tensors: a few thousand numbers whose distances estimate the models' distances.

In peer-to-peer gossip rounds the coordinator sees no message, so it cannot hold the public copies whose
spread is the consensus distance. Each worker reports instead a count sketch of its public copy and of its
message: every coordinate goes to one of ``size`` buckets with a random sign, the same map at every worker of
a run (it follows from each tensor's name and the seed). A sketch is linear, so the coordinator adds a
message's sketch to its sender's once the message is accepted, and for any two models
``E |sketch(a) - sketch(b)|^2 = |a - b|^2``: ``consensus_distance`` of the sketches estimates the consensus
distance of the copies, within about ``sqrt(2 / size)`` of it, relative, for a spread over many coordinates.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

SIZE = 2048


def sketch(tensors: Mapping[str, torch.Tensor], size: int = SIZE, seed: int = 0) -> torch.Tensor:
    """The count sketch of ``tensors`` (float64, ``size`` buckets). The map of each tensor is drawn from a
    generator seeded by the tensor's name, on the CPU, so every holder of the same tensors gets the same bits."""
    out = torch.zeros(size, dtype=torch.float64)
    for name in sorted(tensors):
        flat = tensors[name].detach().reshape(-1).to("cpu", torch.float64)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        buckets = torch.randint(size, (flat.numel(),), generator=gen)
        signs = torch.randint(2, (flat.numel(),), generator=gen, dtype=torch.int8).to(torch.float64).mul_(2).sub_(1)
        out.index_add_(0, buckets, flat * signs)
    return out


def consensus_distance(sketches: Sequence[torch.Tensor]) -> float:
    """The mean over members of ``|s_i - mean_j s_j|^2``: the consensus distance, estimated."""
    if not sketches:
        raise ValueError("no sketches")
    stack = torch.stack([s.double() for s in sketches])
    return float(((stack - stack.mean(dim=0)) ** 2).sum()) / len(sketches)
