"""Streamed fragments (``coordinator train --fragments F``, Streaming DiLoCo): the model's tensors in F groups
of about equal size, synced in turn, so the link carries a steady 1/F of a round's payload instead of a burst.

Pure: a fragment's tensors are a function of the model's shapes and F, so the coordinator and every holder
of a replica name the same ones. Round r syncs fragment ``r mod F`` (``of_round``); each fragment is a
codec of its own over its tensors (``compression.shard.subset``), with error feedback kept apart from the
others' (``ScopedFeedback``: every codec numbers its chunk groups from 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from gradwire.compression.feedback import ErrorFeedback, ScopedFeedback

MAX_FRAGMENTS = 1024


@dataclasses.dataclass(frozen=True)
class Fragment:
    """Fragment ``index`` of the model's tensors split ``count`` ways (``split``)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_FRAGMENTS:
            raise ValueError(f"fragments must be in [1, {MAX_FRAGMENTS}], got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"fragment {self.index} is not one of {self.count}")

    @property
    def key(self) -> str:
        """The prefix of this fragment's error feedback buffers."""
        return f"fragment{self.index}of{self.count}/"


def of_round(round_: int, count: int) -> Fragment | None:
    """The fragment round ``round_`` syncs; ``None`` (the whole model) with one fragment."""
    return Fragment(round_ % count, count) if count > 1 else None


def split(shapes: Mapping[str, Sequence[int]], count: int) -> tuple[tuple[str, ...], ...]:
    """The tensors of each of ``count`` fragments, each in the model's order: largest tensor first to the
    fragment with the fewest elements so far (ties to the lower index), so each holds about 1/count of the
    elements and of a payload's bytes. ``ValueError`` for more fragments than tensors."""
    if not 1 <= count <= min(MAX_FRAGMENTS, len(shapes)):
        raise ValueError(f"--fragments must be in [1, {min(MAX_FRAGMENTS, len(shapes))}] for this model, got {count}")
    load = [0] * count
    owner: dict[str, int] = {}
    for name in sorted(shapes, key=lambda n: -math.prod(shapes[n])):  # stable: equal sizes keep model order
        f = min(range(count), key=lambda i: (load[i], i))
        owner[name] = f
        load[f] += math.prod(shapes[name])
    return tuple(tuple(n for n in shapes if owner[n] == f) for f in range(count))


def scoped(feedback: ErrorFeedback, fragment: Fragment | None) -> ErrorFeedback | ScopedFeedback:
    """``feedback`` as ``fragment``'s codec uses it (itself for the whole model)."""
    return feedback if fragment is None else ScopedFeedback(feedback, fragment.key)
