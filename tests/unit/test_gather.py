"""The gather stage (coordinator.gather): validate -> clip -> judge -> aggregate, with no network.

Rounds are built by hand from real payloads of a small codec; the references (norms, aggregates) are
computed independently from the dense decompressions.
"""

from __future__ import annotations

import dataclasses
import re
import statistics

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig, CompressedGradient, GradientCodec, robust
from gradwire.compression.robust import MEAN, AggregationRule, aggregate
from gradwire.coordinator.decisions import AGREEMENT_FLOOR, HARD_CLIP, Score, Standing
from gradwire.coordinator.gather import Gatherer
from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.protocol import OK, RoundResult

SHAPES = {"w": (64, 48), "b": (48,), "v": (4096,)}
SEQ = 8  # tokens a row trains on: a batch of R rows (R, SEQ + 1) is worth R * SEQ tokens
BOUND = "--clip-factor 2 x the median norm"


@dataclasses.dataclass
class Link:
    """A stand-in for a worker link: the gather stage only reads its address."""

    address: str


@pytest.fixture(scope="module")
def codec() -> GradientCodec:
    return GradientCodec(SHAPES, CodecConfig(topk=32))


def gradient(seed: int, factor: float = 1.0) -> dict[str, torch.Tensor]:
    """An honest sender's gradient: a direction all share plus as much of its own (they agree, as honest
    senders' gradients do: coordinator.agreement)."""
    shared, own = torch.Generator().manual_seed(12345), torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=shared) + torch.randn(s, generator=own)) * factor for k, s in SHAPES.items()}


def slots(n: int) -> list[WorkerSlot]:
    return [WorkerSlot(i, Link(f"10.0.0.{i}:50051")) for i in range(n)]  # type: ignore[arg-type]


def batch(rows: int) -> np.ndarray:
    return np.zeros((rows, SEQ + 1), dtype=np.uint16)


def sent(slot: WorkerSlot, payload: CompressedGradient, rows: int, tokens: int | None = None) -> SlotOutcome:
    """``slot``'s honest-looking result for a batch of ``rows`` rows (``tokens``: a lie about its size)."""
    tokens = rows * SEQ if tokens is None else tokens
    return SlotOutcome(slot, RoundResult(OK, 0, gradient=payload, loss=3.0, tokens=tokens, version=1))


def with_first(payload: CompressedGradient, **changes: object) -> CompressedGradient:
    """``payload`` with its first tensor's fields changed (a corrupted or forged payload)."""
    first, *rest = payload.tensors
    return dataclasses.replace(payload, tensors=(dataclasses.replace(first, **changes), *rest))


def dense_norm(codec: GradientCodec, payload: CompressedGradient) -> float:
    """The norm of what ``payload`` stands for, from its dense decompression (the DCT is orthonormal)."""
    return float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in codec.decompress(payload).values()])))


def weighted_mean(
    codec: GradientCodec, payloads: list[CompressedGradient], weights: list[float], scales: list[float]
) -> dict[str, torch.Tensor]:
    """The clipped mean by hand: sum(w_i * s_i * d_i) / sum(w_i), over dense decompressions."""
    dense = [codec.decompress(p) for p in payloads]
    return {k: sum(w * s * d[k] for d, w, s in zip(dense, weights, scales)) / sum(weights) for k in SHAPES}


def assert_same_aggregate(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = False) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def judged(slot: WorkerSlot) -> Standing:
    """``slot``'s strikes and benching, without its agreement score (tests/unit/test_agreement.py)."""
    return dataclasses.replace(slot.standing, score=Score())


def gatherer(codec: GradientCodec, **kwargs: float) -> Gatherer:
    settings = {"clip_factor": 2.0, "bench_after": 3, "bench_rounds": 5, **kwargs}
    return Gatherer(codec, **settings)  # type: ignore[arg-type]


def test_honest_senders_are_all_kept_and_weighted_by_their_tokens(codec: GradientCodec) -> None:
    workers = slots(3)
    rows = [2, 3, 1]
    payloads = [codec.compress(gradient(i)) for i in range(3)]
    round_ = RoundOutcome([sent(s, p, r) for s, p, r in zip(workers, payloads, rows)], pushes=0, push_bytes=0)
    got = gatherer(codec)(round_, 0, {s.index: batch(r) for s, r in zip(workers, rows)}, MEAN)

    assert [(f.slot, f.address, f.kind, f.reason, f.scale, f.benched) for f in got.fates] == [
        (i, f"10.0.0.{i}:50051", "kept", "", 1.0, "") for i in range(3)
    ]
    assert got.senders == (0, 1, 2) and got.scales == (1.0, 1.0, 1.0)
    assert [r.gradient for r in got.results] == payloads
    assert (got.count("kept"), got.count("clipped"), got.count("left out"), got.count("failed")) == (3, 0, 0, 0)
    assert got.aggregator is not None
    weights = [16.0, 24.0, 8.0]  # rows x SEQ
    assert_same_aggregate(got.aggregator.result(), weighted_mean(codec, payloads, weights, [1.0] * 3))
    assert_same_aggregate(got.aggregator.result(), aggregate(codec, payloads, weights, (1.0,) * 3).result(), exact=True)
    assert all(judged(s) == Standing() for s in workers)  # good rounds: no strikes


def test_a_failed_worker_is_failed_with_its_error_and_no_strike(codec: GradientCodec) -> None:
    workers = slots(2)
    payload = codec.compress(gradient(0))
    error = "worker at 10.0.0.1:50051: UNAVAILABLE: connection refused"
    round_ = RoundOutcome([sent(workers[0], payload, 2), SlotOutcome(workers[1], None, error)], 0, 0)
    got = gatherer(codec)(round_, 4, {0: batch(2), 1: batch(2)}, MEAN)

    fate = got.fates[1]
    assert (fate.slot, fate.address, fate.kind, fate.reason, fate.benched) == (1, "10.0.0.1:50051", "failed", error, "")
    assert got.senders == (0,) and got.count("failed") == 1
    assert judged(workers[1]) == Standing()  # a network failure is not the worker's verdict
    assert got.aggregator is not None
    assert_same_aggregate(got.aggregator.result(), aggregate(codec, [payload], [16.0]).result(), exact=True)


def test_a_false_token_count_is_left_out_naming_both_counts_with_a_strike(codec: GradientCodec) -> None:
    workers = slots(3)
    payloads = [codec.compress(gradient(i)) for i in range(3)]
    outcomes = [
        sent(workers[0], payloads[0], 2),
        sent(workers[1], payloads[1], 2, tokens=160),
        sent(workers[2], payloads[2], 2),
    ]
    got = gatherer(codec)(RoundOutcome(outcomes, 0, 0), 0, {i: batch(2) for i in range(3)}, MEAN)

    fate = got.fates[1]
    assert (fate.kind, fate.reason, fate.benched) == ("left out", "reports 160 tokens for a batch of 16", "")
    assert judged(workers[1]) == Standing(strikes=1)
    assert got.senders == (0, 2)
    assert got.aggregator is not None  # the liar's payload weighs nothing, whatever it claims
    assert_same_aggregate(
        got.aggregator.result(), aggregate(codec, [payloads[0], payloads[2]], [16.0, 16.0]).result(), exact=True
    )


@pytest.mark.parametrize(
    ("forge", "why"),
    [
        ("wrong-shape", "tensor 'w', field 'shape': expected (64, 48), got (65, 49)"),
        ("nan-values", "tensor 'w', field 'values'"),
        ("missing-tensor", "tensor list differs from the plan"),
        ("another-model", "tensor 'w', field 'shape': expected (64, 48), got (32, 48)"),
    ],
)
def test_a_payload_that_does_not_decode_is_left_out_with_a_strike(codec: GradientCodec, forge: str, why: str) -> None:
    workers = slots(3)
    payloads = [codec.compress(gradient(i)) for i in range(3)]
    honest = payloads[1]
    first = honest.tensors[0]
    if forge == "wrong-shape":
        bad = with_first(honest, shape=tuple(s + 1 for s in first.shape))
    elif forge == "nan-values":
        bad = with_first(honest, values=np.full(len(first.values) // 4, np.nan, dtype="<f4").tobytes())
    elif forge == "missing-tensor":
        bad = dataclasses.replace(honest, tensors=honest.tensors[1:])
    else:  # a payload of another model's tensors: decodes, but not against this run's plan
        other = GradientCodec({**SHAPES, "w": (32, 48)}, CodecConfig(topk=32))
        bad = other.compress({**gradient(1), "w": torch.randn(32, 48)})
    outcomes = [sent(workers[0], payloads[0], 2), sent(workers[1], bad, 2), sent(workers[2], payloads[2], 2)]
    got = gatherer(codec)(RoundOutcome(outcomes, 0, 0), 0, {i: batch(2) for i in range(3)}, MEAN)

    fate = got.fates[1]
    assert fate.kind == "left out" and fate.reason.startswith("sent a bad payload: ") and why in fate.reason
    assert judged(workers[1]) == Standing(strikes=1)
    assert got.senders == (0, 2) and got.scales == (1.0, 1.0)
    assert got.aggregator is not None
    assert_same_aggregate(
        got.aggregator.result(), aggregate(codec, [payloads[0], payloads[2]], [16.0, 16.0]).result(), exact=True
    )


def test_a_sender_far_above_the_median_is_left_out(codec: GradientCodec) -> None:
    workers = slots(4)
    payloads = [codec.compress(gradient(i, 1000.0 if i == 3 else 1.0)) for i in range(4)]
    got = gatherer(codec)(
        RoundOutcome([sent(s, p, 2) for s, p in zip(workers, payloads)], 0, 0), 0, {i: batch(2) for i in range(4)}, MEAN
    )

    norms = [dense_norm(codec, p) for p in payloads]
    scale = 2.0 * statistics.median(norms) / norms[3]
    assert scale < HARD_CLIP
    fate = got.fates[3]
    assert fate.kind == "left out" and fate.scale == pytest.approx(scale, rel=1e-3)
    m = re.fullmatch(rf"sent (\S+) x the bound of {BOUND}", fate.reason)
    assert m is not None, fate.reason
    assert float(m[1]) == pytest.approx(1 / scale, rel=1e-2)
    assert judged(workers[3]) == Standing(strikes=1)
    assert [f.kind for f in got.fates[:3]] == ["kept"] * 3
    assert got.senders == (0, 1, 2) and got.scales == (1.0, 1.0, 1.0)
    assert got.aggregator is not None
    assert_same_aggregate(got.aggregator.result(), weighted_mean(codec, payloads[:3], [16.0] * 3, [1.0] * 3))


def test_a_sender_above_the_bound_but_not_far_is_clipped_and_counts_scaled(codec: GradientCodec) -> None:
    workers = slots(4)
    rows = [1, 2, 3, 2]
    payloads = [codec.compress(gradient(i, 3.0 if i == 3 else 1.0)) for i in range(4)]
    got = gatherer(codec)(
        RoundOutcome([sent(s, p, r) for s, p, r in zip(workers, payloads, rows)], 0, 0),
        7,
        {s.index: batch(r) for s, r in zip(workers, rows)},
        MEAN,
    )

    norms = [dense_norm(codec, p) for p in payloads]
    scale = 2.0 * statistics.median(norms) / norms[3]
    assert HARD_CLIP < scale < 1
    fate = got.fates[3]
    assert fate.kind == "clipped" and fate.scale == pytest.approx(scale, rel=1e-3)
    m = re.fullmatch(rf"clipped to (\S+) of its norm \({BOUND}\)", fate.reason)
    assert m is not None, fate.reason
    assert float(m[1]) == pytest.approx(scale, rel=1e-2)
    assert judged(workers[3]) == Standing()  # clipped, not rejected: no strike
    assert got.senders == (0, 1, 2, 3) and got.count("clipped") == 1
    assert got.scales[:3] == (1.0, 1.0, 1.0) and got.scales[3] == fate.scale
    weights = [8.0, 16.0, 24.0, 16.0]
    assert got.aggregator is not None
    # The clipped sender counts at its scale; the others keep their weight (not renormalised upwards).
    assert_same_aggregate(got.aggregator.result(), weighted_mean(codec, payloads, weights, [1.0, 1.0, 1.0, scale]))
    assert_same_aggregate(got.aggregator.result(), aggregate(codec, payloads, weights, got.scales).result(), exact=True)


def test_clip_factor_zero_keeps_every_sender_whole(codec: GradientCodec) -> None:
    workers = slots(3)
    payloads = [codec.compress(gradient(i, 1000.0 if i == 2 else 1.0)) for i in range(3)]
    got = gatherer(codec, clip_factor=0.0)(
        RoundOutcome([sent(s, p, 2) for s, p in zip(workers, payloads)], 0, 0), 0, {i: batch(2) for i in range(3)}, MEAN
    )
    assert [f.kind for f in got.fates] == ["kept"] * 3 and got.scales == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("rule", [AggregationRule(mode="median"), AggregationRule(mode="trimmed-mean", trim=0.25)])
def test_coordinate_rules_aggregate_exactly_the_kept_payloads(codec: GradientCodec, rule: AggregationRule) -> None:
    workers = slots(4)
    payloads = [codec.compress(gradient(i)) for i in range(4)]
    outcomes = [sent(s, p, 2) for s, p in zip(workers, payloads)]
    outcomes[2] = SlotOutcome(workers[2], None, "timed out")
    got = gatherer(codec)(RoundOutcome(outcomes, 0, 0), 0, {i: batch(2) for i in range(4)}, rule)
    kept = [payloads[0], payloads[1], payloads[3]]
    assert got.aggregator is not None
    assert_same_aggregate(
        got.aggregator.result(), aggregate(codec, kept, [16.0] * 3, (1.0,) * 3, rule).result(), exact=True
    )


def test_bench_after_strikes_benches_a_worker_and_a_good_round_brings_it_back(codec: GradientCodec) -> None:
    gather = gatherer(codec, bench_after=2, bench_rounds=5)
    workers = slots(2)

    def round_at(step: int, liar_tokens: int | None) -> tuple[str, str]:
        honest = codec.compress(gradient(100 + step))  # a fresh gradient every round (a repeated one is a copy)
        outcomes = [sent(workers[0], honest, 2), sent(workers[1], codec.compress(gradient(step + 1)), 2, liar_tokens)]
        got = gather(RoundOutcome(outcomes, 0, 0), step, {0: batch(2), 1: batch(2)}, MEAN)
        return got.fates[1].kind, got.fates[1].benched

    assert round_at(0, 99) == ("left out", "")
    assert judged(workers[1]) == Standing(strikes=1)
    kind, benched = round_at(1, 99)
    assert kind == "left out" and benched == "2 bad rounds in a row (rejected again): benched until step 7"
    assert judged(workers[1]) == Standing(0, 7)
    assert [workers[1].standing.benched(s) for s in (2, 6, 7)] == [True, True, False]
    assert judged(workers[0]) == Standing()  # the honest one is never judged otherwise
    # Back at step 7, an honest round clears the benching (the judge's reason says so).
    kind, benched = round_at(7, None)
    assert kind == "kept" and benched == "contribution accepted"
    assert judged(workers[1]) == Standing()


def test_a_good_round_clears_strikes_before_the_bench(codec: GradientCodec) -> None:
    gather = gatherer(codec, bench_after=2, bench_rounds=5)
    workers = slots(2)
    for step, lie in enumerate([99, None, 99]):
        outcomes = [
            sent(workers[0], codec.compress(gradient(0)), 2),
            sent(workers[1], codec.compress(gradient(1)), 2, lie),
        ]
        got = gather(RoundOutcome(outcomes, 0, 0), step, {0: batch(2), 1: batch(2)}, MEAN)
        assert got.fates[1].benched == ""
    assert judged(workers[1]) == Standing(strikes=1)  # strike, cleared, strike: never two in a row


def test_the_norms_memory_keeps_kept_senders_clipped_norms(codec: GradientCodec) -> None:
    gather = gatherer(codec, memory=5)
    workers = slots(5)
    payloads = [codec.compress(gradient(i, {3: 3.0, 4: 1000.0}.get(i, 1.0))) for i in range(5)]
    got = gather(
        RoundOutcome([sent(s, p, 2) for s, p in zip(workers, payloads)], 0, 0), 0, {i: batch(2) for i in range(5)}, MEAN
    )
    assert [f.kind for f in got.fates] == ["kept", "kept", "kept", "clipped", "left out"]
    norms = [dense_norm(codec, p) for p in payloads]
    # Kept senders' norms, the clipped one at its clipped size; the left-out one is not remembered.
    remembered = [*norms[:3], norms[3] * got.fates[3].scale]
    assert list(gather.norms) == pytest.approx(remembered, rel=1e-3)

    # The memory is a bounded window of the most recent.
    for step in range(1, 3):
        fresh = codec.compress(gradient(10 + step))  # a new gradient each round: a repeated one is a copy
        gather(RoundOutcome([sent(workers[0], fresh, 2)], 0, 0), step, {0: batch(2)}, MEAN)
    assert len(gather.norms) == 5 and gather.norms[-1] == pytest.approx(dense_norm(codec, fresh), rel=1e-3)


def test_the_memory_keeps_an_established_sender_from_looking_like_an_outlier(codec: GradientCodec) -> None:
    """Fresh senders (empty error feedback) send tiny payloads: the round's median alone would cut the
    established one; the remembered norms say it is typical."""
    workers = slots(3)
    typical = codec.compress(gradient(0))
    fresh = [codec.compress(gradient(i, 0.01)) for i in (1, 2)]
    outcomes = [sent(workers[0], typical, 2), sent(workers[1], fresh[0], 2), sent(workers[2], fresh[1], 2)]
    batches = {i: batch(2) for i in range(3)}

    forgetful = gatherer(codec)
    assert forgetful(RoundOutcome(outcomes, 0, 0), 0, batches, MEAN).fates[0].kind == "left out"

    workers = slots(3)  # fresh standings
    outcomes = [sent(workers[0], typical, 2), sent(workers[1], fresh[0], 2), sent(workers[2], fresh[1], 2)]
    remembering = gatherer(codec)
    remembering.norms.extend([dense_norm(codec, typical)] * 3)
    got = remembering(RoundOutcome(outcomes, 0, 0), 0, batches, MEAN)
    assert [f.kind for f in got.fates] == ["kept"] * 3


def test_no_usable_contribution_gives_no_aggregator(codec: GradientCodec) -> None:
    workers = slots(2)
    outcomes = [
        SlotOutcome(workers[0], None, "cut off as a straggler"),
        sent(workers[1], codec.compress(gradient(1)), 2, 1),
    ]
    gather = gatherer(codec)
    got = gather(RoundOutcome(outcomes, 0, 0), 0, {0: batch(2), 1: batch(2)}, MEAN)
    assert got.aggregator is None
    assert got.outcomes == () and got.scales == () and got.results == [] and got.senders == ()
    assert [f.kind for f in got.fates] == ["failed", "left out"]
    assert list(gather.norms) == []

    empty = gather(RoundOutcome([], 0, 0), 1, {}, MEAN)
    assert empty.aggregator is None and empty.fates == ()


def test_fates_follow_the_rounds_outcome_order(codec: GradientCodec) -> None:
    workers = slots(3)
    order = [workers[2], workers[0], workers[1]]
    outcomes = [sent(s, codec.compress(gradient(s.index)), 2) for s in order]
    outcomes[1] = SlotOutcome(workers[0], None, "gone")
    got = gatherer(codec)(RoundOutcome(outcomes, 0, 0), 0, {i: batch(2) for i in range(3)}, MEAN)
    assert [(f.slot, f.kind) for f in got.fates] == [(2, "kept"), (0, "failed"), (1, "kept")]
    assert got.senders == (2, 1)


def test_a_sender_pointing_away_is_left_out_benched_and_judged_afresh_when_back(codec: GradientCodec) -> None:
    """A sign flipper at the honest norm (what the clip cannot see): its agreement with the two others is
    negative round after round, so its score falls below the floor from its second round, when it is left
    out, and it is benched after ``bench_after`` such rounds; the honest pair agrees with each other (the
    flipper is peeled off their references) and is never struck."""
    gather = gatherer(codec, bench_after=3, bench_rounds=5)
    workers = slots(3)

    def round_at(step: int, flip: bool = True):
        dense = [gradient(100 * step + i) for i in range(3)]  # fresh gradients every round (repeats are copies)
        if flip:
            dense[2] = {k: -v for k, v in dense[2].items()}
        payloads = [codec.compress(d) for d in dense]
        active = workers if not workers[2].standing.benched(step) else workers[:2]
        outcomes = [sent(s, p, 2) for s, p in zip(active, payloads)]
        return payloads, gather(RoundOutcome(outcomes, 0, 0), step, {i: batch(2) for i in range(3)}, MEAN)

    _, got = round_at(0)  # a fresh score moves only part of the way: no strike yet
    assert [f.kind for f in got.fates] == ["kept"] * 3 and AGREEMENT_FLOOR < got.scores[2] < 0
    for step in range(1, 4):
        payloads, got = round_at(step)
        assert [f.kind for f in got.fates] == ["kept", "kept", "left out"]
        m = re.fullmatch(
            r"points away from the others: agreement (\S+) this round, score (\S+) over (\d) .*", got.fates[2].reason
        )
        assert m is not None, got.fates[2].reason
        assert float(m[1]) < -0.5 and int(m[3]) == step + 1
        assert got.scores[0] > 0 and got.scores[1] > 0 and got.scores[2] == pytest.approx(float(m[2]), abs=5e-3)
        assert got.aggregator is not None  # the honest pair's mean, exactly
        want = aggregate(codec, payloads[:2], [16.0, 16.0], (1.0, 1.0))
        assert_same_aggregate(got.aggregator.result(), want.result(), exact=True)
    assert got.fates[2].benched == "3 bad rounds in a row (rejected again): benched until step 9"
    assert judged(workers[2]) == Standing(0, 9) and workers[2].standing.score == Score()  # its score starts over
    assert judged(workers[0]) == Standing() and judged(workers[1]) == Standing()
    assert workers[0].standing.score.rounds == 4 and workers[0].standing.score.value > 0.3
    # Benched, it sits out; back at step 9 and honest, it starts from a fresh score, and is kept.
    _, got = round_at(5)
    assert got.senders == (0, 1) and 2 not in got.scores
    _, got = round_at(9, flip=False)
    assert [f.kind for f in got.fates] == ["kept"] * 3 and got.scores[2] > 0
    assert workers[2].standing.score.rounds == 1


def test_a_payload_of_zeros_is_left_out_as_empty(codec: GradientCodec) -> None:
    workers = slots(3)
    zeros = codec.compress({k: torch.zeros(s) for k, s in SHAPES.items()})
    outcomes = [sent(workers[0], codec.compress(gradient(0)), 2), sent(workers[1], codec.compress(gradient(1)), 2)]
    outcomes.append(sent(workers[2], zeros, 2))
    got = gatherer(codec)(RoundOutcome(outcomes, 0, 0), 0, {i: batch(2) for i in range(3)}, MEAN)
    fate = got.fates[2]
    assert (fate.kind, fate.reason) == ("left out", "sent an empty payload: every value is zero, for 16 tokens")
    # Two senders left: too few to measure who points away.
    assert judged(workers[2]) == Standing(strikes=1) and got.senders == (0, 1) and got.scores == {}


def test_a_lone_sender_is_not_measured(codec: GradientCodec) -> None:
    workers = slots(1)
    got = gatherer(codec)(
        RoundOutcome([sent(workers[0], codec.compress(gradient(0)), 2)], 0, 0), 0, {0: batch(2)}, MEAN
    )
    assert got.fates[0].kind == "kept" and got.scores == {} and workers[0].standing == Standing()


def test_what_is_measured_of_a_sender_alone_is_taken_as_its_result_arrives(monkeypatch) -> None:
    """The call's thread decodes a result as it arrives (``round._Receiver``) and takes its copy digest and its
    norm (its factored matrices' kept with the factors) then too; the gather stage after the round's close
    reuses them: the same digest, the same clip, the same aggregate, with none of that work left for it."""
    from gradwire.compression.stream import StreamPlan
    from gradwire.coordinator import copies
    from gradwire.coordinator.round import _Receiver

    factored = GradientCodec(SHAPES, CodecConfig(topk=32, rank=4))
    stream = StreamPlan(factored, 1)
    workers = slots(2)
    payloads = [factored.compress(gradient(seed)) for seed in (1, 2)]
    arrived = []
    for w, p in zip(workers, payloads):
        outcome = sent(w, p, 2)
        _Receiver(stream, outcome).finish(outcome.result)
        assert outcome.decoded is not None and outcome.digest is not None and outcome.empty is False
        assert outcome.decoded.dense._norms_sq is not None  # the factored norms, kept with the factors
        assert outcome.norm == robust.payload_norm(factored.decode(p))  # the sender's, for the clip
        arrived.append(outcome)

    def gather(outcomes):
        g = Gatherer(factored, clip_factor=2.0, bench_after=3, bench_rounds=5)
        return g(RoundOutcome(outcomes, 0, 0), 0, {w.index: batch(2) for w in workers}, MEAN)

    taken, normed = [], []
    original, original_norm = copies.digest, robust.payload_norm
    monkeypatch.setattr(copies, "digest", lambda *a: taken.append(1) or original(*a))
    monkeypatch.setattr(robust, "payload_norm", lambda d: normed.append(1) or original_norm(d))
    early = gather(arrived)
    assert taken == [] and normed == []  # nothing measured again after the close
    late = gather([sent(w, p, 2) for w, p in zip(workers, payloads)])
    assert len(taken) == len(normed) == 2  # decoded and measured by the gather stage itself
    assert early.scales == late.scales and early.fates == late.fates
    numels = [g.chunk_numel for g in factored.plan.groups]
    for o in arrived:
        again = original(o.decoded, numels)
        assert np.array_equal(o.digest.sets, again.sets) and np.array_equal(o.digest.replays, again.replays)
    assert early.aggregator.norm() == late.aggregator.norm()

    # A payload of nothing is found so as it arrives, and left out as one found after the close is.
    nothing = sent(workers[1], factored.compress({k: torch.zeros(s) for k, s in SHAPES.items()}), 2)
    _Receiver(stream, nothing).finish(nothing.result)
    assert nothing.empty is True
    fates = gather([arrived[0], nothing]).fates
    assert fates[1].kind == "left out" and fates[1].reason.startswith("sent an empty payload")
