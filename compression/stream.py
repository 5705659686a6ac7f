"""A gradient payload in pieces: sent bucket by bucket as the backward produces it, decoded as it arrives.

A backward produces the last layers' gradients first. ``buckets`` cuts a plan's tensors, taken from the
last to the first, into runs of about equal elements (the way DDP buckets its all-reduces); a worker
compresses each bucket as soon as the backward has filled its gradients and sends it while the backward
goes on. It is a pure function of the plan, so sender and receiver agree on the buckets without saying so.

Every tensor's bytes are the same whether a codec holds the whole model or a subset of it
(``compression.shard``), so the buckets' pieces put together (``shard.assemble``) are, byte for byte, the
payload one codec of the whole model sends. A sender keeps each bucket's error feedback under its own
keys; the values in them are the whole codec's, laid out by bucket.

On the receiving side ``Pieces`` takes one sender's pieces as they come, checks and decodes each against
its bucket's codec, and at the end hands over the whole payload and its ``DecodedGradient`` in the whole
plan's layout, as ``GradientCodec.decode`` of the assembled payload would give them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gradwire.compression.codec import DecodedGradient, GradientCodec
from gradwire.compression.feedback import ErrorFeedback, ScopedFeedback
from gradwire.compression.payload import GRADIENT, CompressedGradient, PayloadError
from gradwire.compression.plan import ModelPlan
from gradwire.compression.shard import assemble, subset

MAX_BUCKETS = 64  # pieces one payload may come in; more only adds calls and framing


def buckets(plan: ModelPlan, count: int) -> tuple[tuple[str, ...], ...]:
    """The plan's tensors in at most ``count`` buckets, in the order a backward fills them (the plan's
    last tensors first), each bucket's names in plan order. A bucket closes where it comes closest to its share of the
    elements left; a tensor is never split, so a large one may make a bucket of its own."""
    if not 1 <= count <= MAX_BUCKETS:
        raise ValueError(f"a payload streams in 1 to {MAX_BUCKETS} buckets, got {count}")
    out: list[tuple[str, ...]] = []
    left = sum(t.numel for t in plan.tensors)
    bucket: list[str] = []
    size = 0

    def close() -> None:
        nonlocal bucket, size, left
        out.append(tuple(reversed(bucket)))
        left -= size
        bucket, size = [], 0

    for t in reversed(plan.tensors):
        target = left / (count - len(out))
        # Close before a tensor that would overshoot the bucket's share by more than stopping short of it.
        if bucket and len(out) < count - 1 and size + t.numel - target > target - size:
            close()
            target = left / (count - len(out))
        bucket.append(t.name)
        size += t.numel
        if size >= target and len(out) < count - 1:
            close()
    if bucket:
        out.append(tuple(reversed(bucket)))
    return tuple(out)


class StreamPlan:
    """The buckets of one codec's plan and a codec for each (built once, shared by every sender)."""

    def __init__(self, codec: GradientCodec, count: int) -> None:
        self.codec = codec
        self.buckets = buckets(codec.plan, count)
        shapes = {t.name: t.shape for t in codec.plan.tensors}
        whole = (tuple(shapes),)
        self.codecs = (  # one bucket, the whole plan (nothing streams): the codec itself, not a second one
            (codec,)
            if self.buckets == whole
            else tuple(
                GradientCodec(
                    subset(shapes, names), codec.config, codec.device, codec.transform_dtype, codec.factorization
                )
                for names in self.buckets
            )
        )
        self._index = {names: b for b, names in enumerate(self.buckets)}
        # Where each bucket's decoded rows go in the whole plan's layout.
        where = {}
        for gi, group in enumerate(codec.plan.groups):
            for t, off in zip(group.members, group.offsets):
                where[t.name] = (gi, off)
        dense_at = {t.name: i for i, t in enumerate(codec.plan.dense)}
        self._rows = []  # per bucket: (its group, its first row, the whole group, the whole's first row, rows)
        self._dense = []  # per bucket: (its dense index, the whole's dense index)
        for bucket in self.codecs:
            self._rows.append(
                [
                    (si, off, *where[t.name], t.num_chunks)
                    for si, group in enumerate(bucket.plan.groups)
                    for t, off in zip(group.members, group.offsets)
                ]
            )
            self._dense.append([(di, dense_at[t.name]) for di, t in enumerate(bucket.plan.dense)])

    def compress(
        self, b: int, grads: Mapping[str, torch.Tensor], feedback: ErrorFeedback | None = None
    ) -> CompressedGradient:
        """Bucket ``b``'s piece of ``grads`` (which may hold more tensors), with its own error feedback in
        ``feedback`` (keys ``bucket<b>of<count>/...``)."""
        scoped = ScopedFeedback(feedback, f"bucket{b}of{len(self.buckets)}/") if feedback is not None else None
        return self.codecs[b].compress({n: grads[n] for n in self.buckets[b]}, scoped)

    def bucket_of(self, piece: CompressedGradient) -> int:
        """Which bucket ``piece`` holds; ``PayloadError`` unless its tensors are exactly one bucket's."""
        names = tuple(t.name for t in piece.tensors)
        if names not in self._index:
            raise PayloadError(
                names[0] if names else GRADIENT,
                "name",
                f"a piece must hold exactly one of the {len(self.buckets)} buckets' tensors, in plan order",
            )
        return self._index[names]

    def merge(self, decoded: Sequence[DecodedGradient]) -> DecodedGradient:
        """Every bucket's decoded piece (by bucket) as the whole plan's ``DecodedGradient``."""
        plan, device = self.codec.plan, self.codec.device
        indices = [torch.empty((g.num_chunks, g.k), dtype=torch.int64, device=device) for g in plan.groups]
        values = [torch.empty((g.num_chunks, g.k), dtype=torch.float32, device=device) for g in plan.groups]
        dense: list[torch.Tensor | None] = [None] * len(plan.dense)
        factors = {name: f for d in decoded for name, f in d.factors.items()}
        for b, d in enumerate(decoded):
            for si, sub, gi, whole, rows in self._rows[b]:
                indices[gi][whole : whole + rows] = d.indices[si][sub : sub + rows]
                values[gi][whole : whole + rows] = d.values[si][sub : sub + rows]
            for di, wi in self._dense[b]:
                dense[wi] = d.dense[di]
        assert all(t is not None for t in dense)
        ordered = {t.name: factors[t.name] for t in plan.dense if t.name in factors}
        increasing = bool(decoded) and all(d.increasing for d in decoded)  # rows move whole: each stays as it was
        return DecodedGradient(indices, values, dense, factors=ordered, increasing=increasing)  # type: ignore[arg-type]


class Pieces:
    """One sender's payload as it streams in: ``take`` each piece (checked and decoded on arrival),
    ``finish`` with the round's result's own gradient."""

    def __init__(self, stream: StreamPlan) -> None:
        self.stream = stream
        self.received: dict[int, tuple[CompressedGradient, DecodedGradient]] = {}

    def take(self, piece: CompressedGradient) -> None:
        """Check and decode one piece; ``PayloadError`` says what is wrong with it."""
        b = self.stream.bucket_of(piece)
        if b in self.received:
            raise PayloadError(piece.tensors[0].name, "name", f"bucket {b} came twice")
        self.received[b] = (piece, self.stream.codecs[b].decode(piece))

    def finish(self, rest: CompressedGradient) -> tuple[CompressedGradient, DecodedGradient]:
        """The whole payload and its decoded form. ``rest`` (the result's own gradient) holds every tensor
        when nothing was streamed, and none when every bucket came as a piece; anything else, or a piece
        missing, is a ``PayloadError``."""
        stream = self.stream
        if not self.received:
            return rest, stream.codec.decode(rest)
        if rest.tensors:
            raise PayloadError(rest.tensors[0].name, "name", "a streamed payload's last message repeats tensors")
        missing = [b for b in range(len(stream.buckets)) if b not in self.received]
        if missing:
            raise PayloadError(stream.buckets[missing[0]][0], "name", f"buckets {missing[:5]} never came")
        if rest.settings != stream.codec.config or rest.format_version != self.received[0][0].format_version:
            raise PayloadError(GRADIENT, "settings", "the last message's codec settings differ from its pieces'")
        pieces = [self.received[b] for b in range(len(stream.buckets))]
        payload = assemble(stream.codec.plan, [p for p, _ in pieces])
        return payload, stream.merge([d for _, d in pieces])
