"""The balancer (coordinator.balance): throughput estimates and the split of a round's rows, as pure
functions; and the planner (coordinator.work) turning shares into rows, with no network."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from gradwire.assets import corpus_path, default_tokenizer
from gradwire.coordinator.balance import MIN_SAMPLES, Slot, Throughput, apportion, measure, shares
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import StreamingTokenSource
from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.coordinator.work import WorkPlanner
from gradwire.protocol import OK, RoundResult

SEQ = 16


# --------------------------------------------------------------------------------------------- measure


def test_the_first_measurement_is_replaced_then_averaged() -> None:
    first = measure(None, 1000, 2.0)  # a first round's one-time costs
    assert first == Throughput(500.0, 1)
    second = measure(first, 1000, 1.0)
    assert second == Throughput(1000.0, 2) and MIN_SAMPLES == 2
    third = measure(second, 1000, 0.5, alpha=0.5)
    assert third == Throughput(1500.0, 3)  # halfway to the 2000 tokens/s it showed


def test_a_straggler_cut_off_only_lowers_the_estimate_and_nothing_is_learnt_from_no_time() -> None:
    known = Throughput(1000.0, 5)
    assert measure(known, 1000, 0.5, finished=False) == known  # "at most 2000 tokens/s": nothing new
    lower = measure(known, 1000, 4.0, finished=False, alpha=0.5)
    assert lower is not None and lower.rate == 625.0 and lower.samples == 6
    assert measure(known, 1000, 0.0) == known and measure(None, 0, 1.0) is None


# --------------------------------------------------------------------------------------------- shares


def _slots(rates: list[float | None], current: list[int] | None = None, default: int = 8) -> list[Slot]:
    current = current or [default] * len(rates)
    return [Slot(1, default, rate, cur) for rate, cur in zip(rates, current)]


def test_unmeasured_workers_get_the_default_shares() -> None:
    split, why = shares(_slots([None, None, None]))
    assert split.rows == (8, 8, 8) and "no worker measured" in why


def test_a_worker_half_as_fast_gets_half_a_fast_ones_rows_after_the_patience() -> None:
    slots = _slots([2000.0, 2000.0, 1000.0])
    waiting, why = shares(slots, 0, patience=2)
    assert waiting.rows == (8, 8, 8) and waiting.imbalanced == 1 and "1 of 2" in why
    moved, why = shares(slots, waiting.imbalanced, patience=2)
    assert moved.imbalanced == 0 and "in proportion to throughput" in why
    assert sum(moved.rows) == 24 and moved.rows[2] == 5 and moved.rows[:2] in ((10, 9), (9, 10))
    # Once there, the predicted finish times agree: kept, however often it is asked.
    rates = [2000.0, 2000.0, 1000.0]
    kept, why = shares(_slots(rates, list(moved.rows)), 0)
    assert kept.rows == moved.rows and "kept" in why


def test_noise_within_the_tolerance_moves_nothing() -> None:
    split, _ = shares(_slots([1000.0, 850.0]), 5, tolerance=0.25)
    assert split.rows == (8, 8) and split.imbalanced == 0  # an imbalance must be in a row, not in total


def test_no_worker_is_starved_and_nodes_get_rows_for_every_rank() -> None:
    slots = [Slot(1, 4, 10_000.0, 4), Slot(2, 8, 10.0, 8), Slot(2, 8, 10_000.0, 8)]
    split, _ = shares(slots, 1, patience=2)
    assert sum(split.rows) == 20 and split.rows[1] == 2  # one row per rank, however slow
    assert all(r % s.unit == 0 for r, s in zip(split.rows, slots))


def test_a_joiner_gets_its_default_and_the_others_keep_their_proportions() -> None:
    slots = [Slot(1, 8, 2000.0, 10), Slot(1, 8, 1000.0, 6), Slot(1, 8, None, None)]
    split, why = shares(slots)
    assert split.rows == (10, 6, 8) and "changed" in why
    # ...and a worker that left leaves its rows to the others, in proportion to their throughput when
    # they are imbalanced, at once (the shares are not settled).
    split, _ = shares([Slot(1, 8, 2000.0, 8), Slot(1, 8, 1000.0, 8)], patience=5)
    assert split.rows == (8, 8)  # settled: the patience applies
    split, _ = shares([Slot(1, 8, 2000.0, 12), Slot(1, 8, 1000.0, 12)], patience=5)
    assert split.rows == (11, 5)


def test_apportion_keeps_the_total_exact_and_says_when_the_units_cannot() -> None:
    assert apportion([3.3, 3.3, 3.4], [1, 1, 1], 10) == (3, 3, 4)
    assert apportion([0.1, 9.9], [1, 1], 10) == (1, 9)  # at least one unit each
    assert apportion([5.0, 5.0], [2, 4], 10) in ((2, 8), (6, 4))
    assert apportion([2.5, 2.5], [2, 2], 5) is None
    split, why = shares([Slot(2, 2, 1.0, 2), Slot(3, 3, 1000.0, 3)], 1, patience=2)
    assert sum(split.rows) == 5 and all(r % u == 0 for r, u in zip(split.rows, (2, 3)))


# --------------------------------------------------------------------------------------------- planner


@dataclasses.dataclass
class _Link:
    address: str


def _slot(index: int, address: str, ranks: int = 1) -> WorkerSlot:
    return WorkerSlot(index, _Link(address), ranks=ranks)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def text() -> str:
    return corpus_path().read_text(encoding="utf-8")[:60_000]


def _planner(text: str, tmp_path: Path, **changes: object) -> WorkPlanner:
    settings = dict(model="gpt-tiny", batch_size=4, sequence_length=SEQ, output_dir=str(tmp_path), steps=50)
    config = TrainConfig(**{**settings, **changes})  # type: ignore[arg-type]
    data = StreamingTokenSource(lambda: [(text, True)], default_tokenizer(), seq_len=SEQ, n_slots=2, val_rows=4)
    return WorkPlanner(config, data, config.codec_config(), np.dtype(np.int32))


def _measured(planner: WorkPlanner, rates: dict[str, float]) -> None:
    for address, rate in rates.items():
        planner.estimates[address] = Throughput(rate, MIN_SAMPLES)


def _rows(work) -> list[np.ndarray]:
    return list(work.batches.values())


def test_shares_become_rows_that_tile_the_stream_and_a_retry_sends_the_same(text: str, tmp_path: Path) -> None:
    planner = _planner(text, tmp_path)
    slots = [_slot(0, "a"), _slot(1, "b")]
    _measured(planner, {"a": 3000.0, "b": 1000.0})
    planner.imbalanced = 1
    first = _rows(planner.work(0, slots))
    assert [len(b) for b in first] == [6, 2]  # 8 rows, 3 : 1
    retried = _rows(planner.work(0, slots))  # a failed round, planned again: the same rows
    assert all(np.array_equal(a, b) for a, b in zip(first, retried))
    second = _rows(planner.work(1, slots))
    ordered = np.concatenate(first + second)
    assert len({r.tobytes() for r in ordered}) == len(ordered) == 16
    assert all(ordered[i][-1] == ordered[i + 1][0] for i in range(len(ordered) - 1))  # none skipped


def test_balance_off_and_unmeasured_workers_send_what_the_defaults_send(text: str, tmp_path: Path) -> None:
    slots = [_slot(0, "a"), _slot(1, "b", ranks=2)]
    off = _planner(text, tmp_path / "off", balance="off")
    on = _planner(text, tmp_path / "on")
    for step in range(3):
        a, b = off.work(step, slots), on.work(step, slots)
        assert [len(x) for x in _rows(a)] == [4, 8]
        assert all(np.array_equal(x, y) for x, y in zip(_rows(a), _rows(b)))
        assert (a.micro_batch_size, b.micro_batch_size) == (0, 4)  # a bigger share goes in micro-batches


def test_balance_steps_gives_each_worker_its_own_inner_steps(text: str, tmp_path: Path) -> None:
    slots = [_slot(0, "a"), _slot(1, "b")]
    planner = _planner(text, tmp_path, inner_steps=4, balance="steps")
    default = _planner(text, tmp_path / "off", inner_steps=4, balance="off").work(0, slots)
    even = planner.work(0, slots)
    assert all(np.array_equal(x, y) for x, y in zip(_rows(even), _rows(default)))  # the default shares: off's rows
    _measured(planner, {"a": 3000.0, "b": 1000.0})
    planner.imbalanced = 1
    work = planner.work(1, slots)
    orders = {i: work.order("run", i, 0, None, None) for i in (0, 1)}  # type: ignore[arg-type]
    steps = [orders[i].local_steps.steps for i in (0, 1)]  # type: ignore[union-attr]
    assert steps == [6, 2] and [len(orders[i].batch) for i in (0, 1)] == [24, 8]
    lrs = planner.config.inner_lrs(1)
    assert orders[1].local_steps.learning_rates == (lrs[0], lrs[2])  # type: ignore[union-attr]
    # The round's rows are those of its 4 data steps in the default layout, cut otherwise.
    cut = [planner.data.batch(4 + h, p, 4, SEQ).astype(np.int32) for h in range(4) for p in (0, 1)]
    assert sorted(r.tobytes() for r in np.concatenate(_rows(work))) == sorted(r.tobytes() for r in np.concatenate(cut))


def test_a_resumed_planner_decides_the_next_shares_as_the_one_that_went_on(text: str, tmp_path: Path) -> None:
    planner = _planner(text, tmp_path, overlap=True)
    slots = [_slot(0, "a"), _slot(1, "b")]
    _measured(planner, {"a": 3000.0, "b": 1000.0})
    planner.work(0, slots)  # --overlap: round 1's shares are decided with round 0's
    state = planner.state(1, ["a", "b"])
    fresh = _planner(text, tmp_path / "b", overlap=True)
    fresh.restore(state, ["c", "b"])  # "c" takes the place of "a", which is not in the run any more
    assert fresh.estimates["c"] == planner.estimates["a"]
    new = [_slot(0, "c"), _slot(1, "b")]
    assert fresh.plan(1, new).shares == planner.plans[1].shares != (4, 4)
    assert fresh.plan(2, new) == dataclasses.replace(planner.plan(2, slots), workers=("c", "b"))


def test_observe_measures_what_the_coordinator_waited_for(text: str, tmp_path: Path) -> None:
    planner = _planner(text, tmp_path)
    a, b, c, d = (_slot(i, name) for i, name in enumerate("abcd"))
    work = planner.work(0, [a, b, c, d])
    outcomes = [
        SlotOutcome(a, RoundResult(OK, 0, tokens=64), seconds=0.5),  # 4 rows of 16 tokens in 0.5 s
        SlotOutcome(b, None, "cut off", straggler=True, seconds=1.0),  # a bound: at most 64 tokens/s
        SlotOutcome(c, RoundResult(OK, 0, tokens=64), seconds=0.5, pushes=1),  # a push's time: not its speed
        SlotOutcome(d, None, "failed", seconds=0.1),  # nothing to learn
    ]
    planner.observe(work, RoundOutcome(outcomes, 0, 0))
    assert planner.estimates == {"a": Throughput(128.0, 1), "b": Throughput(64.0, 1)}
    record = planner.record(work)
    assert record["worker_rows"] == {"a": 4, "b": 4, "c": 4, "d": 4} and record["rows_min"] == 4
    assert record["worker_tokens_per_sec"] == {"a": 128.0, "b": 64.0}


def test_balance_is_checked_and_steps_needs_local_sgd() -> None:
    with pytest.raises(ValueError, match="--balance must be one of off, rows, steps"):
        TrainConfig(balance="fast")
    with pytest.raises(ValueError, match="--balance steps .*--inner-steps > 1"):
        TrainConfig(balance="steps")
    assert TrainConfig().balance == "rows" and TrainConfig(inner_steps=2, balance="steps").balance == "steps"


@pytest.mark.parametrize("local_sgd", [False, True], ids=["gradient", "local-sgd"])
def test_a_redundancy_check_gives_its_group_the_same_rows_no_more_than_each_ones_share(
    text: str, tmp_path: Path, local_sgd: bool
) -> None:
    """Workers of unequal shares (a fast and a slow one) still share rows: per inner step, the first rows of
    the first one's, as many as the smaller share; the round's other rows are not sent to anyone twice."""
    changes = {"inner_steps": 2, "inner_learning_rate": 1e-3} if local_sgd else {}
    planner = _planner(text, tmp_path, **changes)
    planner.redundancy = (1, 0)  # every round draws a check
    slots = [_slot(0, "fast:1"), _slot(1, "slow:1")]
    _measured(planner, {"fast:1": 3000.0, "slow:1": 1000.0})
    for _ in range(3):  # shares move only after PATIENCE imbalanced decisions
        planner.plan(len(planner.plans), slots)
    step = len(planner.plans)
    plain = WorkPlanner(planner.config, planner.data, planner.codec, planner.batch_dtype)
    plain.estimates, plain.current, plain.imbalanced = dict(planner.estimates), dict(planner.current), 0
    own = plain.work(step, slots).batches  # what each would have got without the check
    work = planner.work(step, slots)
    assert set(work.redundant) == {0, 1}
    shares = [own[0].shape[0], own[1].shape[0]]
    assert shares[0] != shares[1]  # the shares differ
    h = 2 if local_sgd else 1
    rows = min(shares) // h
    first = own[work.redundant[0]]
    per = first.shape[0] // h
    expected = np.concatenate([first[i * per : i * per + rows] for i in range(h)])
    for slot in (0, 1):
        assert np.array_equal(work.batches[slot], expected)
        assert work.batches[slot].shape[0] <= own[slot].shape[0]
