"""What each worker did in a round, as the status page names it (coordinator.status.worker_events). Pure."""

from __future__ import annotations

import dataclasses

from gradwire.coordinator.decisions import Standing
from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.coordinator.status import WORKER_STATES, WorkerEvent, worker_events
from gradwire.protocol import OK, RoundResult


@dataclasses.dataclass
class Link:
    address: str


def slot(index: int, **fields: object) -> WorkerSlot:
    return WorkerSlot(index, Link(f"w{index}:50051"), **fields)  # type: ignore[arg-type]


def result(total: float | None = 1.5) -> RoundResult:
    timings = {"compute": 1.0} if total is None else {"compute": 1.0, "total": total}
    return RoundResult(OK, 3, loss=2.0, tokens=64, version=3, timings=timings)


def test_a_kept_worker_is_training_with_its_bytes_and_seconds() -> None:
    s = slot(0, device="cuda:0", ranks=2, node_mode="fsdp")
    o = SlotOutcome(s, result(2.25), bytes_up=100, bytes_down=700, first_push_bytes=5000)
    (event,) = worker_events([s], RoundOutcome([o], pushes=1, push_bytes=5000), {0}, 4)
    # bytes_down counts the state push before the round, which SlotOutcome.bytes_down does not.
    assert event == WorkerEvent(
        0, "w0:50051", "training", "cuda:0", 2, "fsdp", 2.25, 100, 5700, "", utilisation=1.0 / 2.25, wait=0.0
    )


def test_a_kept_worker_that_was_pushed_or_caught_up_is_resyncing() -> None:
    slots = [slot(0), slot(1), slot(2)]
    outcomes = [
        SlotOutcome(slots[0], result(), pushes=1, bytes_down=9000),
        SlotOutcome(slots[1], result(), catch_ups=1, bytes_down=300),
        SlotOutcome(slots[2], result()),
    ]
    events = worker_events(slots, RoundOutcome(outcomes, 1, 0), {0, 1, 2}, 4)
    assert [(e.state, e.bytes_down) for e in events] == [("resyncing", 9000), ("resyncing", 300), ("training", 0)]


def test_a_straggler_is_straggling_without_an_error() -> None:
    s = slot(0)
    o = SlotOutcome(s, None, "cut off as a straggler (CANCELLED)", bytes_down=400, straggler=True)
    (event,) = worker_events([s], RoundOutcome([o], 0, 0), set(), 4)
    assert (event.state, event.error, event.seconds, event.bytes_down) == ("straggling", "", 0.0, 400)


def test_a_failed_or_left_out_worker_is_failed() -> None:
    slots = [slot(0), slot(1), slot(2)]
    error = "worker at w0:50051: UNAVAILABLE: gone"
    outcomes = [
        SlotOutcome(slots[0], None, error, bytes_down=250),
        SlotOutcome(slots[1], result(0.75), bytes_up=80, bytes_down=90),  # answered, but the gather left it out
        SlotOutcome(slots[2], result(None)),  # kept, with no total time reported
    ]
    events = worker_events(slots, RoundOutcome(outcomes, 0, 0), {2}, 4)
    assert [(e.state, e.error, e.seconds, e.bytes_up, e.bytes_down) for e in events] == [
        ("failed", error, 0.0, 0, 250),
        ("failed", "", 0.75, 80, 90),
        ("training", "", 0.0, 0, 0),
    ]


def test_a_worker_without_an_outcome_is_benched_joining_or_waiting() -> None:
    slots = [slot(0), slot(1, standing=Standing(0, until=6)), slot(2), slot(3), slot(4, standing=Standing(0, until=5))]
    round_ = RoundOutcome([SlotOutcome(slots[0], result())], 1, 0, joining=(2, 4))
    events = worker_events(slots, round_, {0}, 5)
    assert [(e.id, e.state) for e in events] == [
        (0, "training"),
        (1, "benched"),  # benched for step 5 (the round after this one)
        (2, "resyncing"),  # receiving the state in the background
        (3, "waiting"),  # joined after the round began
        (4, "resyncing"),  # its benching is over at step 5; it is getting the state
    ]
    assert all((e.seconds, e.bytes_up, e.bytes_down, e.error) == (0.0, 0, 0, "") for e in events[1:])
    assert all((e.ranks, e.node_mode) == (1, "") for e in events)  # single devices: no mode
    assert {e.state for e in events} <= set(WORKER_STATES)


def test_benched_wins_over_joining_and_events_follow_the_slots() -> None:
    slots = [slot(3, standing=Standing(0, until=9)), slot(1)]
    gone = slot(7)  # left the run after the round: no event
    outcomes = [SlotOutcome(slots[1], result()), SlotOutcome(gone, result())]
    events = worker_events(slots, RoundOutcome(outcomes, 0, 0, joining=(3,)), {1, 7}, 2)
    assert [(e.id, e.address, e.state) for e in events] == [(3, "w3:50051", "benched"), (1, "w1:50051", "training")]


def test_no_slots_no_events() -> None:
    assert worker_events([], RoundOutcome([], 0, 0), set(), 0) == []


def test_a_left_out_worker_shows_why_and_a_failed_call_keeps_its_own_error() -> None:
    slots = [slot(0), slot(1)]
    outcomes = [SlotOutcome(slots[0], None, "worker at w0:50051: UNAVAILABLE: gone"), SlotOutcome(slots[1], result())]
    reasons = {0: "not this one", 1: "reports 10 tokens for a batch of 64"}
    events = worker_events(slots, RoundOutcome(outcomes, 0, 0), set(), 4, reasons)
    assert [(e.state, e.error) for e in events] == [
        ("failed", "worker at w0:50051: UNAVAILABLE: gone"),
        ("failed", "reports 10 tokens for a batch of 64"),
    ]
