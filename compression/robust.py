"""Robust aggregation: clip each sender to a multiple of the round's median norm, then combine by mean,
kept-mean, coordinate-wise trimmed mean or coordinate-wise median, all in the DCT-coefficient domain.

Pure functions of the senders' payloads, their weights (token counts) and the rule, so the coordinator
and every worker that replays an update compute the same aggregate from the same bytes:

* ``payload_norm`` - a payload's L2 norm from its coefficients (the transform is orthonormal, so this is
  the norm of the gradient it stands for);
* ``clip_scales`` - templar's rule: sender i is scaled by ``min(1, factor * median(norms) / norm_i)``, so
  no sender outweighs ``factor`` typical ones however large it makes its payload;
* ``aggregate`` - the combined update as an ``Aggregator``-like object (``norm()``, ``result()``).

``mean`` is the weighted mean of the clipped senders (normalised by the unclipped weights: a clipped
sender counts for less, it does not make the others count for more). ``kept-mean`` is the same weighted
mean taken per coefficient over the senders that sent it (a coefficient only one of two equal senders kept
is that sender's value, not half of it; dense tensors, sent whole by all, are the plain mean): what
templar/SparseLoCo apply (``scatter_reduce(reduce="mean", include_self=False)``); the clipped values over
the unclipped weights again. ``trimmed-mean`` and ``median`` are
unweighted, per coefficient, over the senders' dense coefficient tensors (a coefficient a sender did not
send is 0 for it): they defend against a minority that sends large values in the same places, and suit
payloads whose kept coefficients overlap (dense rounds, error-fed top-k late in training); with sparse,
disjoint top-k sets they shrink the update towards 0. The default is ``mean`` with clipping.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterator, Sequence

import torch

from gradwire.compression import products
from gradwire.compression.aggregate import Aggregator, in_plan_order, unchunk_group
from gradwire.compression.codec import CompressedGradient, DecodedGradient, GradientCodec
from gradwire.compression.dct import idct_chunks

AGGREGATIONS: tuple[str, ...] = ("mean", "kept-mean", "trimmed-mean", "median")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AggregationRule:
    """How a round's senders combine.

    Attributes:
        mode: ``mean`` (weighted by tokens), ``kept-mean`` (weighted by tokens, per coefficient over the
            senders that sent it), ``trimmed-mean`` or ``median`` (per coefficient, unweighted).
        trim: ``trimmed-mean`` drops this fraction of the senders from each end of every coefficient's
            sorted values (at least one each side once there are three senders).
        exact: combine and transform in float64, rounding once to float32 at the end, so that replicas on
            different device kinds (a CPU coordinator, CUDA workers) compute the same bits and a sign
            step cannot flip where they sum in another order (``decisions.replay_precision`` decides).
    """

    mode: str = "mean"
    trim: float = 0.25
    exact: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.exact else torch.float32

    def __post_init__(self) -> None:
        if self.mode not in AGGREGATIONS:
            raise ValueError(f"--aggregate must be one of {', '.join(AGGREGATIONS)}, got {self.mode!r}")
        if not (math.isfinite(self.trim) and 0 <= self.trim < 0.5):
            raise ValueError(f"the trimmed fraction must be in [0, 0.5), got {self.trim}")


MEAN = AggregationRule()


def payload_norm(d: DecodedGradient) -> float:
    """L2 norm of a decoded payload, from its kept coefficients, dense values and factors (a factored
    matrix's norm from k x k products of its factors, never the matrix)."""
    items = products.items(d.dense)
    parts = [torch.linalg.vector_norm(v.float()).double() for v in (*d.values, *products.tensors(items))]
    if isinstance(d.dense, products.Products) and (known := d.dense.norms_sq()):  # kept for the aggregate's norm
        factored_sq = torch.stack(list(known.values())).sum()
    elif factored := products.factored(items):
        factored_sq = products.norm_sq(factored)
    else:
        factored_sq = None
    if factored_sq is not None:
        parts.append(factored_sq.clamp_min(0).sqrt().to(parts[0].device if parts else "cpu"))
    return float(torch.linalg.vector_norm(torch.stack(parts))) if parts else 0.0


def clip_scales(norms: Sequence[float], factor: float, reference: float | None = None) -> tuple[float, ...]:
    """Per sender, ``min(1, factor * median / norm)``; all 1 when ``factor`` is 0 (clipping off).

    ``median`` is the median of ``norms``, or ``reference`` if that is larger: a caller that remembers
    what typical senders sent in earlier rounds passes it, so that a round where most senders are fresh
    (restarted workers, whose error feedback is empty, send far smaller payloads) does not make an
    established one look like an outlier."""
    if factor <= 0 or not norms:
        return tuple(1.0 for _ in norms)
    bound = factor * max(statistics.median(norms), reference or 0.0)
    return tuple(1.0 if n <= bound else bound / n for n in norms)


def aggregate(
    codec: GradientCodec,
    senders: Sequence[CompressedGradient | DecodedGradient],
    weights: Sequence[float],
    scales: Sequence[float] = (),
    rule: AggregationRule = MEAN,
    norms: Sequence[float | None] = (),
) -> Aggregator | CoordinateAggregate:
    """The round's aggregate of ``senders`` (validated first: ``PayloadError`` before anything is summed).
    ``norms``: each sender's ``payload_norm`` where already taken (a sole sender's aggregate norm is then its)."""
    if len(weights) != len(senders) or any(x and len(x) != len(senders) for x in (scales, norms)):
        raise ValueError(f"{len(senders)} senders, {len(weights)} weights, {len(scales)} scales, {len(norms)} norms")
    scales = tuple(scales) or (1.0,) * len(senders)
    for s in scales:
        if not (math.isfinite(s) and 0 <= s <= 1):
            raise ValueError(f"clip scales must be in [0, 1], got {s}")
    decoded = [d if isinstance(d, DecodedGradient) else codec.decode(d) for d in senders]
    if rule.mode in ("mean", "kept-mean"):
        agg = codec.aggregator("mean" if rule.mode == "mean" else "per_coordinate", dtype=rule.dtype)
        for d, w, s, n in zip(decoded, weights, scales, tuple(norms) or (None,) * len(decoded)):
            agg.add(d, float(w), scale=float(s), norm=n)
        return agg
    return CoordinateAggregate(codec, decoded, scales, rule)


class CoordinateAggregate:
    """Per-coefficient median or trimmed mean over senders (their dense coefficient tensors, clipped)."""

    def __init__(
        self, codec: GradientCodec, decoded: Sequence[DecodedGradient], scales: Sequence[float], rule: AggregationRule
    ) -> None:
        if not decoded:
            raise ValueError("nothing to aggregate: no senders")
        self.codec, self.rule = codec, rule
        n = len(decoded)
        plan, device = codec.plan, codec.device
        self._groups: list[torch.Tensor] = []  # (B, chunk_numel) per group
        for gi, g in enumerate(plan.groups):
            stack = torch.zeros(n, g.num_chunks, g.chunk_numel, device=device, dtype=rule.dtype)  # (S, B, chunk_numel)
            for si, (d, s) in enumerate(zip(decoded, scales)):
                stack[si].scatter_add_(1, d.indices[gi], d.values[gi].to(rule.dtype) * s)
            self._groups.append(self._combine(stack))
        self._dense = [
            self._combine(torch.stack([d.dense[ti].to(rule.dtype) * s for d, s in zip(decoded, scales)]))
            for ti in range(len(plan.dense))
        ]

    def _combine(self, stack: torch.Tensor) -> torch.Tensor:
        """(S, ...) -> (...): the rule's statistic over senders."""
        n = stack.shape[0]
        if self.rule.mode == "median":
            # The mean of the two middle values for an even count: symmetric, so a replay in any order agrees.
            ordered = stack.sort(dim=0).values
            return ordered[(n - 1) // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        cut = max(1, int(n * self.rule.trim)) if n >= 3 else 0
        return stack.sort(dim=0).values[cut : n - cut].mean(dim=0)

    def coefficient_groups(self) -> Iterator[torch.Tensor]:
        """The combined coefficients, (B, chunk_numel) per chunk group (``Aggregator.coefficient_groups``)."""
        return iter(self._groups)

    def dense_values(self) -> Iterator[torch.Tensor]:
        return iter(self._dense)

    def norm(self) -> float:
        parts = [torch.linalg.vector_norm(t) for t in (*self._groups, *self._dense)]
        return float(torch.linalg.vector_norm(torch.stack(parts).double())) if parts else 0.0

    def result(self) -> dict[str, torch.Tensor]:
        return in_plan_order(self.codec, self.parts())

    def parts(self) -> Iterator[dict[str, torch.Tensor]]:
        """``result()`` a chunk group at a time, then the dense tensors (``Aggregator.parts``)."""
        codec = self.codec
        for g, coefficients in zip(codec.plan.groups, self._groups):
            stack = coefficients.view(g.num_chunks, *g.chunk_shape)
            if codec.config.use_dct:
                stack = idct_chunks(stack)
            yield unchunk_group(codec, g, stack.float())
        if codec.plan.dense:
            yield {t.name: values.float().view(t.shape) for t, values in zip(codec.plan.dense, self._dense)}
