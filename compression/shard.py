"""Encoding one payload on several ranks: each rank compresses the tensors it owns, rank 0 assembles them.

Everything the codec does past the chunk stack is per chunk (the DCT, the top-k) or per tensor (the
quantization's shift, scale and table), so compressing a subset of a model's tensors gives, tensor for
tensor, the bytes the whole model's codec gives. A sharded node uses that: ``owners`` splits the tensors
among the ranks (each then holds the error feedback of its own tensors only, about 1/N of the whole), every
rank runs a ``GradientCodec`` over its own tensors (``subset``), and ``assemble`` merges the ranks' partial
payloads - compressed bytes, never dense tensors - into the payload a single device would have sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradwire.compression.payload import CompressedGradient
from gradwire.compression.plan import ModelPlan


def owners(plan: ModelPlan, world: int) -> tuple[tuple[str, ...], ...]:
    """The tensors each of ``world`` ranks encodes, each list in payload order: largest tensors first to
    the least loaded rank (by elements, which the error feedback and the transform scale with), ties to the
    lower rank. A pure function of the plan, so every rank computes the same split."""
    if world < 1:
        raise ValueError(f"a node has at least one rank, got {world}")
    load = [0] * world
    owner: dict[str, int] = {}
    for t in sorted(plan.tensors, key=lambda t: -t.numel):  # stable: equal sizes keep payload order
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[t.name] = rank
        load[rank] += t.numel
    return tuple(tuple(t.name for t in plan.tensors if owner[t.name] == r) for r in range(world))


def subset(shapes: Mapping[str, Sequence[int]], names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of ``names`` only, in their payload order: what a rank's own codec is built over."""
    return {name: tuple(shapes[name]) for name in names}


def assemble(plan: ModelPlan, parts: Sequence[CompressedGradient]) -> CompressedGradient:
    """One payload in ``plan``'s order from the ranks' partial payloads, which together must hold every
    planned tensor exactly once, under the plan's codec settings. ``ValueError`` says what is wrong."""
    if not parts:
        raise ValueError("no rank's payload to assemble")
    by_name = {}
    for rank, part in enumerate(parts):
        if part.settings != plan.config or part.format_version != parts[0].format_version:
            raise ValueError(f"rank {rank} encoded with other codec settings or format")
        for t in part.tensors:
            if t.name in by_name:
                raise ValueError(f"tensor {t.name!r} was encoded by two ranks")
            by_name[t.name] = t
    planned = [t.name for t in plan.tensors]
    missing, extra = [n for n in planned if n not in by_name], sorted(set(by_name) - set(planned))
    if missing or extra:
        raise ValueError(f"the ranks' payloads miss {missing[:3]} and add {extra[:3]}")
    return CompressedGradient(plan.config, tuple(by_name[n] for n in planned), parts[0].format_version)
