"""A round's metrics record (``round_record``) and the progress shown while a run trains (``ProgressLog``,
``progress``), with an injected clock and an in-memory stream."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec
from gradwire.coordinator.gather import Fate, Gathered
from gradwire.coordinator.metrics import (
    METRIC_KEYS,
    MetricsLog,
    ProgressBar,
    ProgressLog,
    progress,
    read_metrics,
    round_record,
)
from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.protocol import OK, RoundResult

SHAPES = {"w": (64, 48), "b": (48,)}
DENSE_BYTES = 4 * (64 * 48 + 48)


@dataclasses.dataclass
class Link:
    address: str


def a_round() -> tuple[RoundOutcome, Gathered]:
    """Four workers: 0 kept, 1 cut off as a straggler, 2 clipped, 3 left out (its result is not used)."""
    codec = GradientCodec(SHAPES, CodecConfig(topk=32))
    g = torch.Generator().manual_seed(0)
    p0, p2, p3 = (codec.compress({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}) for _ in range(3))
    slots = [WorkerSlot(i, Link(f"w{i}:1"), ranks=2 if i == 0 else 1) for i in range(4)]  # type: ignore[arg-type]
    r0 = RoundResult(
        OK,
        7,
        gradient=p0,
        loss=2.0,
        tokens=64,
        version=7,
        node_bytes=10,
        grad_norm=3.0,
        timings={"compute": 1.0, "update": 0.2, "compress": 0.3, "total": 1.6},
    )
    r2 = RoundResult(
        OK,
        7,
        gradient=p2,
        loss=5.0,
        tokens=32,
        version=7,
        grad_norm=0.5,
        timings={"compute": 2.5, "update": 0.1, "compress": 0.4},
    )
    r3 = RoundResult(OK, 7, gradient=p3, loss=9.0, tokens=32, version=7, grad_norm=100.0, timings={"compute": 9.0})
    outcomes = [
        SlotOutcome(slots[0], r0, bytes_up=1000, bytes_down=200, catch_ups=1),
        SlotOutcome(slots[1], None, "cut off as a straggler", bytes_down=50, straggler=True),
        SlotOutcome(slots[2], r2, bytes_up=900, bytes_down=100),
        SlotOutcome(slots[3], r3, bytes_up=800, bytes_down=100),
    ]
    fates = (
        Fate(0, "w0:1", "kept", ""),
        Fate(1, "w1:1", "failed", "cut off as a straggler"),
        Fate(2, "w2:1", "clipped", "clipped to 0.5 of its norm", 0.5),
        Fate(3, "w3:1", "left out", "sent 40 x the bound", 0.01),
    )
    return RoundOutcome(outcomes, pushes=2, push_bytes=4000), Gathered(
        (outcomes[0], outcomes[2]), None, (1.0, 0.5), fates, {0: 0.62, 2: 0.05}
    )


def test_round_record_arithmetic(tmp_path: Path) -> None:
    round_, gathered = a_round()
    record = round_record(
        8,
        round_,
        gathered,
        grad_norm=0.125,
        lr=1e-3,
        times=(10.0, 12.5, 14.0),
        total_tokens=5000,
        dense_bytes=DENSE_BYTES,
        inner_steps=1,
        benched=1,
        clip_grad_norm=1.0,
    )
    assert set(METRIC_KEYS) <= set(record)
    payload_bytes = sum(r.gradient.nbytes for r in gathered.results if r.gradient is not None)
    tokens = 96  # the used results' only: the left-out worker's 32 are not trained on
    bytes_up = 1000 + 900 + 800  # every worker's traffic counts, used or not
    bytes_down = 200 + 50 + 100 + 100 + 4000  # and the state pushes
    want = {
        "step": 8,
        "loss": (2.0 * 64 + 5.0 * 32) / tokens,  # weighted by tokens
        "grad_norm": 0.125,
        "tokens_per_sec": tokens / 4.0,
        "compression_ratio": DENSE_BYTES * 2 / payload_bytes,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "bytes_down_per_worker": (200 + 50 + 100 + 100) / 4,  # the orders, without the pushes
        "step_time": 4.0,
        "dispatch_time": 2.5,
        "aggregate_time": 1.5,
        "successful_workers": 2,
        "total_tokens": 5000,
        "lr": 1e-3,
        "pushes": 2,
        "ranks": 3,
        "tokens_per_sec_per_worker": tokens / 4.0 / 2,
        "node_bus_bytes": 10,
        "inner_steps": 1,
        "inner_loss": 3.0,
        "bytes_up_per_token": bytes_up / tokens,
        "bytes_down_per_token": bytes_down / tokens,
        "worker_compute_time": 2.5,  # the slowest used worker's
        "worker_update_time": 0.2,
        "worker_compress_time": 0.4,
        "worker_grad_norm": (3.0 + 0.5) / 2,
        "grad_clipped": 1,  # 3.0 > --clip-grad-norm 1; the left-out 100 is not a sender
        "clipped": 1,
        "rejected": 1,
        "benched": 1,
        "catch_ups": 1,
        "bytes_pulled": 0,  # --relay peers only
        "relay_resent": 0,
        "relay_failed": 0,
        "stragglers": 1,
        "agreement_min": 0.05,  # the senders' lowest agreement score
        "utilisation": 1.0 / 1.6,  # the senders' mean compute / wall (or total); r2 has no span: not measured
        "wait_s": 0.0,  # none reported a wait: busy all along
        "worker_wall_s": 1.6,  # the senders' spans: r1's total (no wall); r2 has none
    }
    assert record.pop("worker_utilisation") == {"w0:1": 0.625}  # by address, the measured senders'
    assert record == pytest.approx(want)
    assert payload_bytes < DENSE_BYTES * 2 and record["compression_ratio"] > 1
    with MetricsLog(tmp_path) as log:  # a record the log takes as is
        log.append(record)
    assert read_metrics(tmp_path) == [pytest.approx(want)]


def test_without_clip_grad_norm_nothing_counts_as_grad_clipped() -> None:
    round_, gathered = a_round()
    record = round_record(
        1,
        round_,
        gathered,
        grad_norm=1.0,
        lr=0.1,
        times=(0.0, 1.0, 2.0),
        total_tokens=96,
        dense_bytes=DENSE_BYTES,
        inner_steps=30,
        benched=0,
    )
    assert (record["grad_clipped"], record["worker_grad_norm"], record["inner_steps"]) == (0, 1.75, 30)


# ------------------------------------------------------------------------------------------- progress


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(step: int) -> dict[str, float]:
    return {"step": step, "loss": 2.5, "tokens_per_sec": 1234.4, "bytes_up": 1500, "bytes_down": 700_000}


LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (step .*)")


def lines(stream: io.StringIO) -> list[str]:
    out = []
    for line in stream.getvalue().splitlines():
        m = LINE.fullmatch(line)
        assert m is not None, line
        out.append(m[1])
    return out


def test_a_line_every_so_often_and_a_last_one_at_close() -> None:
    clock, stream = Clock(100.0), io.StringIO()
    log = ProgressLog(10, every=30.0, stream=stream, clock=clock)
    clock.now = 110.0
    log.update(record(1))
    assert stream.getvalue() == ""  # 10 s: not yet
    clock.now = 131.0
    log.update(record(2))
    # ETA: 8 steps left at 31 s per 2 steps = 124 s; bytes are the run's so far.
    assert lines(stream) == ["step 2/10 | loss 2.5000 | 1,234 tok/s | up 3.0 KB, down 1.4 MB | ETA 0:02:04"]
    clock.now = 140.0
    log.update(record(3))
    assert len(lines(stream)) == 1  # 9 s since the last line
    clock.now = 150.0
    log.close()
    assert lines(stream)[1] == "step 3/10 | loss 2.5000 | 1,234 tok/s | up 4.5 KB, down 2.1 MB | ETA 0:01:57"
    log.close()
    assert len(lines(stream)) == 2  # nothing new since: no repeat


def test_close_right_after_a_line_writes_nothing_more() -> None:
    clock, stream = Clock(0.0), io.StringIO()
    log = ProgressLog(10, every=5.0, stream=stream, clock=clock)
    clock.now = 6.0
    log.update(record(1))
    clock.now = 7.0
    log.close()
    assert [line.split(" |")[0] for line in lines(stream)] == ["step 1/10"]


def test_every_zero_writes_only_at_close_and_nothing_without_updates() -> None:
    clock, stream = Clock(0.0), io.StringIO()
    log = ProgressLog(4, every=0.0, stream=stream, clock=clock)
    for step in range(1, 5):
        clock.now = 1000.0 * step
        log.update(record(step))
    assert stream.getvalue() == ""
    log.close()
    assert lines(stream) == ["step 4/4 | loss 2.5000 | 1,234 tok/s | up 6.0 KB, down 2.8 MB | ETA 0:00:00"]

    idle = io.StringIO()
    ProgressLog(4, every=0.0, stream=idle, clock=clock).close()
    assert idle.getvalue() == ""


def test_a_resumed_run_counts_its_eta_from_where_it_resumed() -> None:
    clock, stream = Clock(0.0), io.StringIO()
    log = ProgressLog(100, 40, every=1.0, stream=stream, clock=clock)
    clock.now = 10.0
    log.update(record(41))
    assert lines(stream)[0].startswith("step 41/100 | ") and lines(stream)[0].endswith("| ETA 0:09:50")  # 59 x 10 s
    slow = ProgressLog(1000, every=0.0, stream=io.StringIO(), clock=Clock(0.0))
    slow.update(record(1))
    assert slow.line(4.0).endswith("| ETA 1:06:36")  # 999 steps x 4 s
    assert slow.line(0.0).endswith("| ETA 0:00:00")


def test_progress_is_a_log_on_a_stream_that_is_not_a_terminal() -> None:
    stream = io.StringIO()
    shown = progress(10, 2, enabled=True, every=5.0, stream=stream)
    assert isinstance(shown, ProgressLog)
    assert shown.stream is stream and (shown.every, shown.total) == (5.0, 10)
    shown.update(record(3))
    shown.close()
    assert lines(stream)[0].startswith("step 3/10 | ")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_quiet_when_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress(10, enabled=True, stream=Terminal())
    assert isinstance(bar, ProgressBar)
    bar.close()
    stream = io.StringIO()
    quiet = progress(10, 3, enabled=False, stream=stream)
    assert isinstance(quiet, ProgressBar) and quiet._bar.disable
    quiet.update(record(4))
    quiet.update(record(5))
    assert quiet.n == 5  # still counting
    quiet.close()
    assert stream.getvalue() == "" and capsys.readouterr().err == ""
