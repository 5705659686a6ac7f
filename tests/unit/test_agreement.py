"""Leave-one-out agreement (coordinator.agreement) and the score it moves (decisions.score), with no network.

Payloads are built as ``DecodedGradient``s by hand; the reference cosine is computed from each sender's
dense coefficients and the others' dense sum, with no slicing and no taking one's own part back out.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.compression.codec import DecodedGradient
from gradwire.coordinator import agreement
from gradwire.coordinator.agreement import agreements, leave_one_out
from gradwire.coordinator.decisions import (
    AGREEMENT_FLOOR,
    AGREEMENT_WEIGHT,
    Score,
    Standing,
    judge,
    score,
)
from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.coordinator.status import StatusBoard, worker_events
from gradwire.protocol import OK, RoundResult

NUMELS = (64, 16)  # two chunk groups: chunks of 64 and of 16 coefficients
CHUNKS = (12, 5)
K = (8, 4)
DENSE = 6


def payload(seed: int, base: int | None = None, noise: float = 0.3) -> DecodedGradient:
    """A sender's top-k of (a shared direction ``base`` + its own noise), or of noise alone."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(1000 + (base or 0))
    indices, values = [], []
    for numel, chunks, k in zip(NUMELS, CHUNKS, K):
        x = torch.randn(chunks, numel, generator=g)
        if base is not None:
            x = torch.randn(chunks, numel, generator=shared) + noise * x
        idx = x.abs().topk(k, dim=1).indices  # (chunks, k)
        indices.append(idx)
        values.append(x.gather(1, idx))
    dense = torch.randn(DENSE, generator=g)
    if base is not None:
        dense = torch.randn(DENSE, generator=shared) + noise * dense
    return DecodedGradient(indices, values, [dense])


def negated(d: DecodedGradient) -> DecodedGradient:
    return DecodedGradient(d.indices, [-v for v in d.values], [-x for x in d.dense])


def coefficients(d: DecodedGradient) -> list[torch.Tensor]:
    """Each group's (chunks, numel) dense coefficients (a repeated index sums) and its listed mask."""
    out = []
    for idx, vals, numel in zip(d.indices, d.values, NUMELS):
        dense = torch.zeros(idx.shape[0], numel, dtype=torch.float64)
        listed = torch.zeros(idx.shape[0], numel, dtype=torch.bool)
        for row in range(idx.shape[0]):
            for i, v in zip(idx[row].tolist(), vals[row].tolist()):
                dense[row, i] += v
                listed[row, i] = True
        out.append((dense, listed))
    return out


def reference(decoded: list[DecodedGradient], weights: list[float]) -> list[float | None]:
    parts = [coefficients(d) for d in decoded]
    out: list[float | None] = []
    for s, d in enumerate(decoded):
        dot = own_sq = others_sq = 0.0
        for gi in range(len(NUMELS)):
            own, mine = parts[s][gi]
            others = sum(w * parts[t][gi][0] for t, w in enumerate(weights) if t != s)
            theirs = torch.zeros_like(mine)
            for t, w in enumerate(weights):
                if t != s and w:
                    theirs |= parts[t][gi][1]
            shared = mine & theirs
            dot += float((own * others)[shared].sum())
            own_sq += float((own * own)[shared].sum())
            others_sq += float((others * others)[shared].sum()) if isinstance(others, torch.Tensor) else 0.0
        own_dense = d.dense[0].double()
        others_dense = sum(w * decoded[t].dense[0].double() for t, w in enumerate(weights) if t != s)
        dot += float((own_dense * others_dense).sum())
        own_sq += float((own_dense * own_dense).sum())
        others_sq += float((others_dense * others_dense).sum()) if isinstance(others_dense, torch.Tensor) else 0.0
        out.append(dot / (own_sq * others_sq) ** 0.5 if own_sq * others_sq > 0 else None)
    return out


def test_each_sender_is_measured_against_the_weighted_sum_of_the_others_over_shared_coefficients() -> None:
    decoded = [payload(1, base=0), payload(2, base=0), payload(3), negated(payload(4, base=0))]
    weights = [16.0, 32.0, 8.0, 4.0]
    got = leave_one_out(decoded, weights, NUMELS)
    want = reference(decoded, weights)
    assert got == pytest.approx(want, abs=1e-9)
    assert got[0] > 0.5 and got[1] > 0.5 and got[3] < -0.5  # agreeing, agreeing, pointing away
    assert abs(got[2]) < 0.5  # noise of its own: no direction to speak of


def test_a_sender_pointing_away_is_peeled_off_the_others_references() -> None:
    """Two honest senders and a sign flipper: measured against one honest peer and the flipper, an honest
    sender's reference is the peer's direction minus another honest direction, near nothing; with the
    flipper peeled off, each honest one is measured against its peer."""
    honest = [payload(1, base=0), payload(2, base=0)]
    flipper = negated(payload(3, base=0))
    decoded, weights = [*honest, flipper], [16.0, 16.0, 16.0]
    plain = leave_one_out(decoded, weights, NUMELS)
    assert plain[2] < -0.5 and max(plain[0], plain[1]) < 0.3  # the flipper spoils its peers' references
    got = agreements(decoded, weights, NUMELS)
    assert got == pytest.approx(leave_one_out(decoded, [16.0, 16.0, 0.0], NUMELS), abs=1e-12)
    assert got[0] > 0.5 and got[1] > 0.5 and got[2] < -0.5
    # Three honest senders: nobody is peeled.
    three = [*honest, payload(4, base=0)]
    assert agreements(three, weights, NUMELS) == leave_one_out(three, weights, NUMELS)
    # Two senders pointing opposite ways: who is right is unknown, so nothing is measured (nor struck);
    # nor is anything with a third sender of weight 0.
    assert leave_one_out([honest[0], flipper], [1.0, 1.0], NUMELS)[0] < -0.5
    assert agreements([honest[0], flipper], [1.0, 1.0], NUMELS) == [None, None]
    assert agreements(decoded, [1.0, 1.0, 0.0], NUMELS) == [None, None, None]


def test_slices_of_chunks_measure_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = [payload(1, base=0), payload(2, base=0), payload(3, base=0, noise=2.0)]
    whole = leave_one_out(decoded, [1.0, 2.0, 3.0], NUMELS)
    # 5 chunks a slice of the first group (3 senders of 8 pairs a chunk): 3 slices of it
    monkeypatch.setattr(agreement, "SLICE_ELEMENTS", 3 * 8 * 5)
    assert leave_one_out(decoded, [1.0, 2.0, 3.0], NUMELS) == pytest.approx(whole, abs=1e-12)


def test_a_lone_sender_or_one_with_no_weighted_other_is_not_measured() -> None:
    assert leave_one_out([payload(1, base=0)], [4.0], NUMELS) == [None]
    assert leave_one_out([], [], NUMELS) == []
    a, b = payload(1, base=0), payload(2, base=0)
    # b weighs 0: measured against a, but in no one's reference, so a has nothing to be measured against.
    got = leave_one_out([a, b], [4.0, 0.0], NUMELS)
    assert got[0] is None and got[1] == pytest.approx(reference([a, b], [4.0, 0.0])[1], abs=1e-9) and got[1] > 0.5
    with pytest.raises(ValueError, match="2 payloads, 1 weights"):
        leave_one_out([a, b], [1.0], NUMELS)


def test_a_zero_payload_has_no_cosine() -> None:
    a = payload(1, base=0)
    zero = DecodedGradient(a.indices, [torch.zeros_like(v) for v in a.values], [torch.zeros(DENSE)])
    got = leave_one_out([payload(2, base=0), zero], [1.0, 1.0], NUMELS)
    assert got[1] is None and got[0] is None  # its peer's reference is all zeros too


def test_only_shared_coefficients_count() -> None:
    a = payload(1, base=0)
    # b sends a's values where a sends them, and large values of the opposite sign where a sends nothing:
    # the cosine sees only the shared part.
    b_idx, b_vals = [], []
    for idx, vals, numel in zip(a.indices, a.values, NUMELS):
        unsent = torch.ones(idx.shape[0], numel).scatter_(1, idx, 0.0)  # (chunks, numel): 1 where a sends nothing
        others = unsent.topk(idx.shape[1], dim=1).indices  # as many indices a never sends
        assert unsent.gather(1, others).all()
        b_idx.append(torch.cat([idx, others], dim=1))
        b_vals.append(torch.cat([vals, -100 * vals], dim=1))
    b = DecodedGradient(b_idx, b_vals, [a.dense[0].clone()])
    assert leave_one_out([a, b], [1.0, 1.0], NUMELS) == pytest.approx([1.0, 1.0])


def test_a_repeated_index_counts_once_at_its_summed_value() -> None:
    a, b = payload(1, base=0), payload(2, base=0)
    # b lists its first coefficient of every chunk twice, half the value each time: the same payload.
    split = DecodedGradient(
        [torch.cat([i[:, :1], i], dim=1) for i in b.indices],
        [torch.cat([v[:, :1] / 2, torch.cat([v[:, :1] / 2, v[:, 1:]], dim=1)], dim=1) for v in b.values],
        b.dense,
    )
    assert leave_one_out([a, split], [1.0, 1.0], NUMELS) == pytest.approx(leave_one_out([a, b], [1.0, 1.0], NUMELS))


def test_a_score_moves_a_share_of_the_way_to_each_rounds_agreement_and_strikes_below_the_floor() -> None:
    s, verdict, why = score(Score(), None)
    assert (s, verdict) == (Score(), "ok") and why == "no agreement measured"
    # A sign flipper (-0.9 a round), from a fresh score: not struck for its first round, then every round.
    s, verdict, why = score(Score(), -0.9)
    assert (s, verdict) == (Score(pytest.approx(-0.9 * AGREEMENT_WEIGHT), 1), "ok")
    assert why == f"agreement -0.90, score {s.value:+.2f} over 1 round(s)"
    for rounds in range(2, 5):
        before = s.value
        s, verdict, why = score(s, -0.9)
        assert s == Score(pytest.approx((1 - AGREEMENT_WEIGHT) * before + AGREEMENT_WEIGHT * -0.9), rounds)
        assert verdict == "rejected" and s.value < AGREEMENT_FLOOR
    assert why == (
        f"points away from the others: agreement -0.90 this round, score {s.value:+.2f} over 4 round(s) "
        f"(below {AGREEMENT_FLOOR:+g})"
    )
    # Agreeing as honest ones do brings it back above the floor within a few rounds: the strikes stop.
    verdicts = []
    for _ in range(4):
        s, verdict, _ = score(s, 0.9)
        verdicts.append(verdict)
    assert verdicts[-1] == "ok" and s.value > AGREEMENT_FLOOR
    assert score(Score(), -0.2, floor=0.0)[1] == "rejected"  # a caller's floor


def test_honest_agreement_never_strikes() -> None:
    """Honest workers late in a 200-round gpt-tiny run (coordinator.agreement): single rounds down to -0.9,
    runs of rounds near +0.2. Neither a fresh worker nor one with a record is struck."""
    late = [-0.9, 0.2, -0.4, 0.3, 0.1, -0.65, 0.2, 0.5, -0.2, 0.3]
    for start in (Score(), Score(0.5, 150)):
        s = start
        for a in late:
            s, verdict, _ = score(s, a)
            assert verdict == "ok", s


def test_a_drifting_honest_worker_is_struck_only_while_it_still_points_away_and_is_not_benched() -> None:
    """An honest worker late in a CI run: its score drifted to -0.38 (-0.41 at its lowest), with -0.63, -0.49
    and then -0.28 this round. The last round points away less than the floor: kept, so three strikes in a
    row never come, and it is not benched."""
    standing, verdicts = Standing(score=Score(-0.30, 159)), []
    for step, a in enumerate([-0.63, -0.49, -0.28, -0.45, -0.1], start=160):
        new, verdict, why = score(standing.score, a)
        standing = dataclasses.replace(standing, score=new)
        verdicts.append(verdict)
        standing, _ = judge(standing, step, verdict, bench_after=3, bench_rounds=20)
        assert not standing.benched(step + 1)
    assert verdicts == ["rejected", "rejected", "ok", "rejected", "ok"]
    assert standing.score.value < AGREEMENT_FLOOR and standing.strikes == 0


def test_judge_keeps_the_score_and_benching_starts_it_over() -> None:
    held = Score(-0.5, 4)
    standing, _ = judge(Standing(score=held), 3, "ok", bench_after=3, bench_rounds=5)
    assert standing == Standing(score=held)
    standing, _ = judge(Standing(1, 0, held), 3, "rejected", bench_after=3, bench_rounds=5)
    assert standing == Standing(2, 0, held)
    standing, why = judge(standing, 4, "rejected", bench_after=3, bench_rounds=5)
    assert standing == Standing(0, 10, Score()) and why.endswith("benched until step 10")


@dataclasses.dataclass
class Link:
    address: str


def test_the_status_board_shows_each_measured_workers_score() -> None:
    slots = [WorkerSlot(0, Link("a:1")), WorkerSlot(1, Link("b:2"))]  # type: ignore[arg-type]
    slots[0].standing = Standing(score=Score(0.93, 5))
    result = RoundResult(OK, 0, loss=2.0, tokens=64, version=1)
    events = worker_events(slots, RoundOutcome([SlotOutcome(s, result) for s in slots], 0, 0), {0, 1}, 1)
    assert [e.score for e in events] == [0.93, None]  # not measured yet
    board = StatusBoard(run={})
    board.update(None, events)
    assert [w["score"] for w in board.snapshot()["workers"]] == [0.93, None]
    scores = [line for line in board.prometheus().decode().splitlines() if line.startswith("gradwire_worker_score{")]
    assert scores == ['gradwire_worker_score{address="a:1",worker="0"} 0.93']  # none for the unmeasured
