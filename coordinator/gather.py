"""A round's gather stage: validate -> clip -> judge -> aggregate.

``Gatherer`` takes what the workers returned in one round (``round.RoundOutcome``) and the batches they
were sent, and returns a plain ``Gathered``: the contributions kept, combined by ``--aggregate`` in the
coefficient domain, and one ``Fate`` per worker saying what became of its contribution and why.

1. validate: a result's token count must match the batch it was sent, and its payload must decode
   against the codec's plan and hold something (a payload of zeros adds nothing for the tokens it
   claims); failing any leaves it out. So does a failed spot check (``coordinator.spotcheck``: the sender's
   gradient, recomputed by the coordinator from the rows it was sent, differs), which benches it at once.
   A payload that repeats another's chunk indices, this round's or a recent round's, or those of an update
   the workers were sent as one payload (``remember_sent``), is a copy (``coordinator.copies``) and is left
   out too.
2. clip: each sender is scaled to at most ``--clip-factor`` x the median norm (of this round, or of the
   senders kept in recent rounds if that is larger); one that would keep less than ``HARD_CLIP`` of
   itself is no honest outlier and is left out.
3. agree: each sender still in is measured against the others (``coordinator.agreement``) and its score
   moves (``decisions.score``); one whose score says it points away round after round is left out.
4. judge: each worker's standing moves on its verdict (``decisions.judge``): strikes, benching.
5. aggregate: the kept payloads, weighted by their tokens, with their clip scales.

Which attack each check catches, and which none does, is in ``coordinator.agreement``'s docstring.
The stage remembers the norms it kept (``norms``): checkpoints save them, as part of the trajectory.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from gradwire.compression import PayloadError, products, robust
from gradwire.compression.codec import CompressedGradient, DecodedGradient, GradientCodec
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator import copies
from gradwire.coordinator.agreement import agreements
from gradwire.coordinator.decisions import AGREEMENT_FLOOR, HARD_CLIP, Verdict, judge, score
from gradwire.coordinator.outer import Aggregate
from gradwire.coordinator.round import RoundOutcome, SlotOutcome
from gradwire.protocol import RoundResult

FateKind = Literal["kept", "clipped", "left out", "failed"]
COPY_ROUNDS = 2  # a payload is checked against the kept payloads of this many steps before its own


@dataclasses.dataclass(frozen=True)
class Fate:
    """What became of one worker's contribution this round, and why."""

    slot: int
    address: str
    kind: FateKind
    reason: str
    scale: float = 1.0  # the clip's scale of a kept contribution
    benched: str = ""  # the judge's reason, when this round changed whether the worker is benched


@dataclasses.dataclass(frozen=True)
class Gathered:
    """A round's usable contributions (in payload order), combined, and every worker's fate."""

    outcomes: tuple[SlotOutcome, ...]
    aggregator: Aggregate | None  # None: no contribution was usable
    scales: tuple[float, ...]
    fates: tuple[Fate, ...]
    scores: Mapping[int, float] = dataclasses.field(default_factory=dict)  # senders' agreement scores, by slot
    # Each kept contribution's weight in the aggregate (in payload order): its tokens, shared out among the
    # kept senders that were given the same rows (a spot check by redundancy), so that those rows count once.
    weights: tuple[float, ...] = ()

    @property
    def results(self) -> list[RoundResult]:
        return [o.result for o in self.outcomes if o.result is not None]

    @property
    def senders(self) -> tuple[int, ...]:
        return tuple(o.slot.index for o in self.outcomes)

    def count(self, kind: FateKind) -> int:
        return sum(f.kind == kind for f in self.fates)


class Gatherer:
    """The gather stage of one run, with its memory of typical norms."""

    def __init__(
        self,
        codec: GradientCodec,
        *,
        clip_factor: float,
        bench_after: int,
        bench_rounds: int,
        memory: int = 64,
        agreement_floor: float | None = AGREEMENT_FLOOR,
    ) -> None:
        """``agreement_floor``: the score below which a sender is left out with a strike (``decisions.score``);
        ``None`` measures no agreement."""
        self.codec = codec
        self.clip_factor = clip_factor
        self.agreement_floor = agreement_floor
        self.bench_after, self.bench_rounds = bench_after, bench_rounds
        self.norms: collections.deque[float] = collections.deque(maxlen=memory)  # kept senders' clipped norms
        self.seen: list[copies.Seen] = []  # the kept payloads of the last COPY_ROUNDS steps, for copies

    def __call__(
        self,
        round_: RoundOutcome,
        step: int,
        batches: Mapping[int, np.ndarray],
        rule: AggregationRule,
        caught: Mapping[int, str] | None = None,
        together: Sequence[int] = (),
        codec: GradientCodec | None = None,
    ) -> Gathered:
        """``caught``: the senders (by slot) a spot check caught this round, with why; ``together``: the slots
        given the same rows (a spot check by redundancy); ``codec``: the round's, if not the run's (a round of
        streamed fragments sends one fragment's tensors)."""
        caught, codec = caught or {}, codec or self.codec
        fates: dict[int, Fate] = {}
        verdicts: dict[int, Verdict] = {}
        good: list[SlotOutcome] = []
        decoded: list[DecodedGradient] = []
        for o in round_.outcomes:
            index, address = o.slot.index, o.slot.client.address
            if o.result is None:
                fates[index] = Fate(index, address, "failed", o.error)
                continue
            if index in caught:
                fates[index] = Fate(index, address, "left out", caught[index])
                verdicts[index] = "caught"
                continue
            reason = _invalid(o, batches[index], codec, decoded)
            if reason:
                fates[index] = Fate(index, address, "left out", reason)
                verdicts[index] = "rejected"
                continue
            good.append(o)
        chunk_numels = [g.chunk_numel for g in codec.plan.groups]
        # Taken as each result came in (``round._Receiver``), where it was decoded then.
        digests = [o.digest if o.digest is not None else copies.digest(d, chunk_numels) for o, d in zip(good, decoded)]
        twins = {i for i, o in enumerate(good) if o.slot.index in together}
        copied = copies.find_copies(
            [(o.slot.client.address, d) for o, d in zip(good, digests)], self.seen, step, together=twins
        )
        for position in sorted(copied, reverse=True):
            o = good.pop(position)
            del decoded[position], digests[position]
            fates[o.slot.index] = Fate(o.slot.index, o.slot.client.address, "left out", copied[position])
            verdicts[o.slot.index] = "rejected"
        norms = [o.norm if o.norm is not None else robust.payload_norm(d) for o, d in zip(good, decoded)]
        typical = statistics.median(self.norms) if self.norms else None  # of the senders kept in recent rounds
        scales = robust.clip_scales(norms, self.clip_factor, typical)
        bound = f"--clip-factor {self.clip_factor:g} x the median norm"
        for o, scale in zip(good, scales):
            index, address = o.slot.index, o.slot.client.address
            verdicts[index] = "ok" if scale >= HARD_CLIP else "rejected"
            if scale < HARD_CLIP:
                fates[index] = Fate(index, address, "left out", f"sent {1 / scale:.3g} x the bound of {bound}", scale)
            elif scale < 1:
                fates[index] = Fate(index, address, "clipped", f"clipped to {scale:.3g} of its norm ({bound})", scale)
            else:
                fates[index] = Fate(index, address, "kept", "", scale)
        kept = [i for i, scale in enumerate(scales) if scale >= HARD_CLIP]
        kept, scores = self._agree(good, decoded, scales, kept, fates, verdicts, codec)
        self.norms.extend(norms[i] * scales[i] for i in kept)
        for o in round_.outcomes:
            if o.slot.index in verdicts:
                before = o.slot.standing
                o.slot.standing, why = judge(
                    before, step, verdicts[o.slot.index], bench_after=self.bench_after, bench_rounds=self.bench_rounds
                )
                if o.slot.standing.until != before.until:
                    fates[o.slot.index] = dataclasses.replace(fates[o.slot.index], benched=why)
        outcomes = tuple(good[i] for i in kept)
        kept_scales = tuple(scales[i] for i in kept)
        self.seen = [s for s in self.seen if s.step > step - COPY_ROUNDS] + [
            copies.Seen(good[i].slot.client.address, step, digests[i]) for i in kept
        ]
        aggregator = None
        sharing = max(1, sum(o.slot.index in together for o in outcomes))
        weights = tuple(
            float(o.result.tokens) / (sharing if o.slot.index in together else 1)
            for o in outcomes
            if o.result is not None
        )
        if outcomes:
            kept_norms = [norms[i] for i in kept]  # a sole sender's is the aggregate's, times its scale
            aggregator = robust.aggregate(codec, [decoded[i] for i in kept], weights, kept_scales, rule, kept_norms)
        order = [o.slot.index for o in round_.outcomes]
        return Gathered(outcomes, aggregator, kept_scales, tuple(fates[i] for i in order), scores, weights)

    def _agree(
        self,
        good: list[SlotOutcome],
        decoded: list[DecodedGradient],
        scales: tuple[float, ...],
        kept: list[int],
        fates: dict[int, Fate],
        verdicts: dict[int, Verdict],
        codec: GradientCodec,
    ) -> tuple[list[int], dict[int, float]]:
        """Measure the ``kept`` senders' agreement, move their scores, and leave out those whose score says
        they point away; returns the senders still kept and the scores measured, by slot."""
        if self.agreement_floor is None:
            return kept, {}
        slots = [good[i].slot for i in kept]
        weights = [float(good[i].result.tokens) * scales[i] for i in kept if good[i].result is not None]
        chunk_numels = [g.chunk_numel for g in codec.plan.groups]
        still, scores = [], {}
        for i, slot, agreement in zip(kept, slots, agreements([decoded[i] for i in kept], weights, chunk_numels)):
            new, verdict, why = score(slot.standing.score, agreement, floor=self.agreement_floor)
            slot.standing = dataclasses.replace(slot.standing, score=new)
            if new.rounds:
                scores[slot.index] = new.value
            if verdict == "ok":
                still.append(i)
            else:
                verdicts[slot.index] = verdict
                fates[slot.index] = Fate(slot.index, slot.client.address, "left out", why, scales[i])
        return still, scores

    def remember_sent(self, payload: CompressedGradient, step: int) -> None:
        """The update of round ``step`` the workers are sent as one payload (``--downlink compressed``): a
        worker that sends it back as its own (a free rider) is a copy of it, as of any sender's. (Of another
        top-k than the workers', the default, it is a malformed payload to begin with.)"""
        if payload.settings != self.codec.config:
            return
        digest = copies.digest(self.codec.decode(payload), [g.chunk_numel for g in self.codec.plan.groups])
        self.seen.append(copies.Seen(SENT, step, digest))


SENT = "the coordinator's update"  # who sent a payload the workers were sent (``Gatherer.remember_sent``)


def _invalid(outcome: SlotOutcome, batch: np.ndarray, codec: GradientCodec, decoded: list[DecodedGradient]) -> str:
    """Why ``outcome``'s result cannot be used ("" if it can; its payload, decoded, then joins ``decoded``).
    A payload decoded as it arrived (``round.RoundDispatcher.run``) is not decoded again."""
    result = outcome.result
    assert result is not None
    expected = batch.shape[0] * (batch.shape[1] - 1)
    if result.tokens != expected:
        return f"reports {result.tokens} tokens for a batch of {expected}"
    if outcome.invalid:
        return outcome.invalid
    try:
        d = outcome.decoded if outcome.decoded is not None else codec.decode(result.gradient)  # validate first
    except PayloadError as e:
        return f"sent a bad payload: {e}"
    empty = outcome.empty if outcome.empty is not None else products.all_zero((*d.values, *products.items(d.dense)))
    if empty:
        return f"sent an empty payload: every value is zero, for {result.tokens} tokens"
    decoded.append(d)
    return ""
