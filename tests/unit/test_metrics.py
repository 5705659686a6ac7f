"""Metrics: the JSON-lines log (required keys, appending across runs, strict JSON) and the progress bar."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gradwire.coordinator.gather import Gathered
from gradwire.coordinator.metrics import (
    METRIC_KEYS,
    MetricsLog,
    ProgressBar,
    read_metrics,
    round_record,
    span,
    utilisation,
    waited,
)
from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.protocol import OK, RoundResult


def record(step: int, **extra: object) -> dict[str, object]:
    base: dict[str, object] = {key: float(i) for i, key in enumerate(METRIC_KEYS)}
    base.update(step=step, successful_workers=3, total_tokens=1024 * (step + 1))
    base.update(extra)
    return base


def test_missing_key_raises_naming_it(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    bad = record(0)
    del bad["grad_norm"]
    with pytest.raises(ValueError, match="'grad_norm'"):
        log.append(bad)
    with pytest.raises(ValueError, match="'loss' must be a number"):
        log.append(record(0, loss="low"))
    with pytest.raises(ValueError, match="'lr' must be a number"):
        log.append(record(0, lr=True))
    with pytest.raises(ValueError, match="JSON"):
        log.append(record(0, extra=object()))
    log.close()
    assert read_metrics(tmp_path) == []  # nothing half-written


def test_appends_across_instances(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        log.append(record(0))
        log.append(record(1, note="warmup"))
        # Flushed at once: readable while the log is still open.
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    with MetricsLog(tmp_path) as log:  # a resumed run
        log.append(record(2))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["note"] == "warmup" and rows[0] == record(0)


def test_values_are_strict_json(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        log.append(record(0, loss=np.float32(2.5), grad_norm=torch.tensor(1.5), bytes_up=np.int64(7)))
        log.append(record(1, loss=float("nan"), grad_norm=float("inf"), extra_nan=float("nan")))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}")) for line in lines]
    assert parsed[0]["loss"] == 2.5 and parsed[0]["grad_norm"] == 1.5 and parsed[0]["bytes_up"] == 7
    assert parsed[1]["loss"] is None and parsed[1]["extra_nan"] is None
    rows = read_metrics(tmp_path)
    assert math.isnan(rows[1]["loss"]) and math.isnan(rows[1]["grad_norm"])


def test_a_torn_last_line_is_skipped_and_appending_continues(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        log.append(record(0))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "lo')  # killed mid-write
    with MetricsLog(tmp_path) as log:
        log.append(record(1))
    with pytest.warns(UserWarning, match="truncated"):
        rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]


def test_progress_bar_counts_steps() -> None:
    with ProgressBar(total=10, initial=4, disable=True) as bar:
        assert bar.n == 4
        bar.update(record(4, loss=3.2, tokens_per_sec=12345.0))
        bar.update(record(5))
        assert bar.n == 6
    bar = ProgressBar(total=3)  # not a TTY under pytest: silent, but still usable
    bar.update(record(0))
    bar.close()


# ----------------------------------------------------------------------- utilisation: where time goes


def test_utilisation_is_compute_over_wall() -> None:
    assert utilisation({"compute": 1.5, "wall": 2.0, "total": 1.8, "wait": 0.2}) == pytest.approx(0.75)
    # the idle time before a round counts against it: wall, not total, is the span
    assert utilisation({"compute": 1.0, "total": 1.0, "wall": 4.0}) == pytest.approx(0.25)


def test_utilisation_falls_back_to_total_without_wall() -> None:
    assert utilisation({"compute": 1.0, "update": 0.2, "total": 1.6}) == pytest.approx(0.625)  # an older worker
    assert utilisation({"compute": 1.0, "total": 2.0, "wall": 0.0}) == pytest.approx(0.5)  # the wire leaves out 0


def test_utilisation_is_clamped_to_0_1() -> None:
    # a look-ahead counts compute done before the round's span began
    assert utilisation({"compute": 3.0, "wall": 2.0}) == 1.0
    assert utilisation({"compute": -0.5, "wall": 2.0}) == 0.0
    assert utilisation({"compute": 0.0, "wall": 2.0}) == 0.0


def test_utilisation_without_timings_is_none() -> None:
    assert utilisation({}) is None
    assert utilisation({"total": 2.0, "wall": 3.0}) is None  # no compute
    assert utilisation({"compute": 1.0}) is None  # nothing to divide by
    assert utilisation({"compute": 1.0, "total": 0.0}) is None
    assert utilisation({"compute": float("nan"), "wall": 1.0}) is None
    assert utilisation({"compute": 1.0, "wall": float("inf"), "total": 2.0}) == pytest.approx(0.5)


def test_waited_is_the_wait_timing_absent_as_zero() -> None:
    assert waited({"compute": 1.0, "wait": 0.75}) == 0.75
    assert waited({"compute": 1.0}) == 0.0  # busy all along: the wire leaves out a zero
    assert waited({"wait": -1.0}) == 0.0 and waited({"wait": float("nan")}) == 0.0


def test_a_workers_span_is_its_wall_or_total_time() -> None:
    assert span({"compute": 1.0, "total": 1.2, "wall": 2.5}) == 2.5  # from its previous result to this one
    assert span({"compute": 1.0, "total": 1.2}) == 1.2
    assert span({"compute": 1.0}) == 0.0 and span({"wall": float("nan")}) == 0.0


@dataclasses.dataclass
class Link:
    address: str


def record_of(outcomes: list[SlotOutcome], senders: int) -> dict[str, object]:
    """The record of a round of ``outcomes`` whose first ``senders`` counted."""
    gathered = Gathered(tuple(outcomes[:senders]), None, (1.0,) * senders, ())
    kwargs = dict(grad_norm=1.0, lr=0.1, times=(0.0, 2.5, 3.0), total_tokens=128, dense_bytes=1024, inner_steps=1)
    return round_record(5, RoundOutcome(outcomes, 0, 0), gathered, benched=0, **kwargs)  # type: ignore[arg-type]


def test_a_rounds_record_has_its_senders_mean_utilisation_and_wait(tmp_path: Path) -> None:
    slots = [WorkerSlot(i, Link(f"w{i}:1")) for i in range(3)]  # type: ignore[arg-type]

    def result(**timings: float) -> RoundResult:
        return RoundResult(OK, 4, loss=2.0, tokens=64, version=4, timings=timings)

    outcomes = [
        SlotOutcome(slots[0], result(compute=1.0, total=1.2, wall=1.25)),
        SlotOutcome(slots[1], result(compute=1.0, total=1.1, wall=2.5, wait=1.4)),
        SlotOutcome(slots[2], result(compute=0.1, total=5.0, wait=4.0)),  # left out: not a sender
    ]
    record = record_of(outcomes, 2)
    assert record["utilisation"] == pytest.approx((0.8 + 0.4) / 2)
    assert record["wait_s"] == pytest.approx(1.4)
    assert record["worker_wall_s"] == pytest.approx(1.25 + 2.5)  # the waits' share is 1.4 of it
    assert record["worker_utilisation"] == {"w0:1": 0.8, "w1:1": 0.4}
    # a sender without timings is left out of the mean; none measured: None
    bare = SlotOutcome(slots[0], result())
    record = record_of([bare, outcomes[1]], 2)
    assert (record["utilisation"], record["worker_utilisation"]) == (pytest.approx(0.4), {"w1:1": 0.4})
    record = record_of([bare], 1)
    assert (record["utilisation"], record["wait_s"], record["worker_utilisation"]) == (None, 0.0, {})
    with MetricsLog(tmp_path) as log:  # records the log takes as they are
        log.append(record)
        log.append(record_of(outcomes, 2))
    assert read_metrics(tmp_path)[1]["worker_utilisation"] == {"w0:1": 0.8, "w1:1": 0.4}
