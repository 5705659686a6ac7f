"""Per-step metrics: each round's record (``round_record``), one JSON line per step in
``<output_dir>/metrics.jsonl``, and progress on stderr: a bar on a terminal, a line every ``--log-every``
seconds elsewhere (``progress``).

Every record carries all ``METRIC_KEYS`` (extra keys are allowed), so the log of any run can be read and
compared by the same code. Lines are strict JSON: a non-finite value (a diverged loss) is written as
``null`` and read back as NaN. The file is opened for appending, so a resumed run continues the same log.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol

from tqdm import tqdm

if TYPE_CHECKING:
    from gradwire.coordinator.gather import Gathered
    from gradwire.coordinator.round import RoundOutcome
    from gradwire.coordinator.tracking import Tracker

__all__ = [
    "METRIC_KEYS",
    "METRICS_FILE",
    "MetricsLog",
    "ProgressBar",
    "ProgressLog",
    "RunRecorder",
    "progress",
    "read_metrics",
    "round_record",
    "utilisation",
    "waited",
]

METRIC_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "tokens_per_sec",
    "compression_ratio",
    "bytes_up",
    "bytes_down",
    "step_time",
    "dispatch_time",
    "aggregate_time",
    "successful_workers",
    "total_tokens",
    "lr",
)

METRICS_FILE = "metrics.jsonl"


def _number(key: str, value: Any) -> int | float | None:
    # bool is an int subclass but not a measurement; numpy scalars and 0-d tensors are not JSON-able as is.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        item = getattr(value, "item", None)
        value = item() if callable(item) and getattr(value, "ndim", None) == 0 else value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metric {key!r} must be a number, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def _extra(value: Any) -> Any:
    # Extra keys may hold any JSON value; only scalars need converting (NaN to null, numpy to Python).
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        value = item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _jsonable(record: Mapping[str, Any]) -> dict[str, Any]:
    missing = [k for k in METRIC_KEYS if k not in record]
    if missing:
        raise ValueError(f"metrics record is missing key {missing[0]!r} (missing: {missing})")
    return {str(k): _number(k, v) if k in METRIC_KEYS else _extra(v) for k, v in record.items()}


class MetricsLog:
    """Appends one JSON line per ``append`` to ``<output_dir>/metrics.jsonl``, flushed at once."""

    def __init__(self, output_dir: Path | str) -> None:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / METRICS_FILE
        # A run killed mid-write leaves a partial last line; start on a fresh line so ours stay parseable.
        torn = False
        if self.path.is_file() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the log
        if torn:
            self._file.write("\n")

    def append(self, record: Mapping[str, Any]) -> None:
        values = _jsonable(record)
        try:
            line = json.dumps(values, allow_nan=False)
        except (TypeError, ValueError) as e:  # an extra value JSON cannot hold, or a nested NaN
            raise ValueError(f"metrics record is not JSON-able: {e}") from None
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All records of a metrics file (or of ``<dir>/metrics.jsonl``), with null metrics back as NaN.

    A truncated line (the run was killed while writing it) is skipped with a warning.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{lineno}: skipping a truncated metrics line", stacklevel=2)
                continue
            for key in METRIC_KEYS:
                if key in record and record[key] is None:
                    record[key] = math.nan
            records.append(record)
    return records


class ProgressBar:
    """A step progress bar showing loss and tokens/s; silent when stderr is not a terminal or ``disable``."""

    def __init__(self, total: int, initial: int = 0, *, disable: bool = False) -> None:
        self._n = initial  # a disabled tqdm stops counting, so the count lives here
        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            # None lets tqdm disable itself when its stream is not a TTY (logs, CI).
            disable=True if disable or not sys.stderr.isatty() else None,
        )

    @property
    def n(self) -> int:
        return self._n

    def update(self, record: Mapping[str, Any]) -> None:
        """Advance one step and show the record's loss and tokens/s."""
        postfix: dict[str, str] = {}
        if "loss" in record:
            postfix["loss"] = f"{float(record['loss']):.4f}"
        if "tokens_per_sec" in record:
            postfix["tok/s"] = f"{float(record['tokens_per_sec']):,.0f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._n += 1
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class ProgressLog:
    """Progress where stderr is not a terminal (nohup, a CI log, ``docker logs``): one line every ``every``
    seconds and one at the end: step, loss, tokens/s, bytes up and down so far, and the time left."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        *,
        every: float = 30.0,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.every = total, every
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self._start = self._last_line = clock()
        self._first = initial
        self._record: Mapping[str, Any] | None = None
        self._bytes_up = self._bytes_down = 0
        self._unwritten = False

    def update(self, record: Mapping[str, Any]) -> None:
        self._record = record
        self._bytes_up += int(record.get("bytes_up", 0))
        self._bytes_down += int(record.get("bytes_down", 0))
        self._unwritten = True
        now = self.clock()
        if self.every and now - self._last_line >= self.every:
            self._write(now)

    def close(self) -> None:
        if self._unwritten:
            self._write(self.clock())

    def line(self, now: float) -> str:
        """The progress line as of ``now`` (after at least one ``update``)."""
        assert self._record is not None
        step, done = int(self._record["step"]), int(self._record["step"]) - self._first
        eta = (self.total - step) * (now - self._start) / done if done > 0 else math.nan
        return (
            f"step {step}/{self.total} | loss {float(self._record['loss']):.4f} | "
            f"{float(self._record['tokens_per_sec']):,.0f} tok/s | "
            f"up {_size(self._bytes_up)}, down {_size(self._bytes_down)} | ETA {_duration(eta)}"
        )

    def _write(self, now: float) -> None:
        self.stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.line(now)}\n")
        self.stream.flush()
        self._last_line, self._unwritten = now, False


class Progress(Protocol):
    def update(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def progress(
    total: int, initial: int = 0, *, enabled: bool = True, every: float = 30.0, stream: IO[str] | None = None
) -> Progress:
    """The progress display for a run on ``stream`` (stderr): a bar on a terminal, else a log line every
    ``every`` seconds; nothing when not ``enabled``."""
    stream = stream if stream is not None else sys.stderr
    if enabled and not stream.isatty():
        return ProgressLog(total, initial, every=every, stream=stream)
    return ProgressBar(total, initial, disable=not enabled)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _seconds(timings: Mapping[str, float], key: str) -> float | None:
    value = timings.get(key)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def utilisation(timings: Mapping[str, float]) -> float | None:
    """The share of a round's span a worker spent computing: ``compute / wall``, clamped to [0, 1]. Pure.

    ``wall`` runs from the worker's previous result's end to this one's, so the idle time between rounds
    counts against it; ``compute`` may hold work done ahead (a look-ahead), hence the clamp. Without a
    ``wall`` (a worker that does not report one, or a round with none before it), ``compute / total``.
    ``None``: nothing to say (no compute time, or no span to divide it by)."""
    compute, seconds = _seconds(timings, "compute"), span(timings)
    if compute is None or seconds <= 0:
        return None
    return min(1.0, max(0.0, compute / seconds))


def waited(timings: Mapping[str, float]) -> float:
    """The seconds a worker sat idle before the round's work began (its ``wait`` timing; the wire leaves out
    a zero, so absent is 0). Pure."""
    return max(0.0, _seconds(timings, "wait") or 0.0)


def span(timings: Mapping[str, float]) -> float:
    """The seconds a worker's round spanned, from its previous result's end to this one's (its ``wall``
    timing, or ``total`` without one; 0 if neither): what its ``wait`` is a share of. Pure."""
    return next((s for s in (_seconds(timings, k) for k in ("wall", "total")) if s is not None and s > 0), 0.0)


def round_record(
    step: int,
    round_: RoundOutcome,
    gathered: Gathered,
    *,
    grad_norm: float,
    lr: float,
    times: tuple[float, float, float],
    total_tokens: int,
    dense_bytes: int,
    inner_steps: int,
    benched: int,
    clip_grad_norm: float = 0.0,
) -> dict[str, Any]:
    """The metrics record of a round that had usable contributions. ``step``: rounds done after it;
    ``times``: when it started, when its results were in, when its outer step was done (one clock);
    ``dense_bytes``: one contribution's size as dense float32."""
    usable = gathered.results
    start, gathered_at, done = times
    tokens = sum(r.tokens for r in usable)
    payload_bytes = sum(r.gradient.nbytes for r in usable if r.gradient is not None)
    bytes_up = sum(o.bytes_up for o in round_.outcomes)
    bytes_down = sum(o.bytes_down for o in round_.outcomes) + round_.push_bytes
    loss = sum(r.loss * r.tokens for r in usable) / tokens
    step_time = done - start
    slowest = {
        key: max((r.timings.get(key, 0.0) for r in usable), default=0.0) for key in ("compute", "update", "compress")
    }
    # each sender's utilisation (compute / wall), by address as worker_rows are; unmeasured ones left out
    shares = {
        o.slot.client.address: u
        for o in gathered.outcomes
        if o.result is not None and (u := utilisation(o.result.timings)) is not None
    }
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "tokens_per_sec": tokens / step_time,
        "compression_ratio": dense_bytes * len(usable) / max(1, payload_bytes),
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        # what one worker's order carried (the update, the batch): the downlink per worker (--downlink)
        "bytes_down_per_worker": sum(o.bytes_down for o in round_.outcomes) / max(1, len(round_.outcomes)),
        "step_time": step_time,
        "dispatch_time": gathered_at - start,
        "aggregate_time": done - gathered_at,
        "successful_workers": len(usable),
        "total_tokens": total_tokens,
        "lr": lr,
        "pushes": round_.pushes,
        "ranks": sum(o.slot.ranks for o in gathered.outcomes),
        "tokens_per_sec_per_worker": tokens / step_time / len(usable),
        "node_bus_bytes": sum(r.node_bytes for r in usable),
        "inner_steps": inner_steps,
        "inner_loss": loss,
        "bytes_up_per_token": bytes_up / tokens,
        "bytes_down_per_token": bytes_down / tokens,
        "worker_compute_time": slowest["compute"],
        "worker_update_time": slowest["update"],
        "worker_compress_time": slowest["compress"],
        # the senders' gradient norms before --clip-grad-norm (local-SGD rounds: the mean of their inner steps'),
        # and how many it clipped (counted where the caller passes clip_grad_norm: gradient mode)
        "worker_grad_norm": sum(r.grad_norm for r in usable) / len(usable),
        "grad_clipped": sum(r.grad_norm > clip_grad_norm for r in usable) if clip_grad_norm else 0,
        "clipped": gathered.count("clipped"),
        "rejected": gathered.count("left out"),
        "benched": benched,
        # the lowest agreement score (coordinator.agreement) of this round's senders; None: none measured yet
        "agreement_min": min(gathered.scores.values(), default=None),
        "catch_ups": sum(o.catch_ups for o in round_.outcomes),
        # --relay peers: the payload bytes the workers pulled from each other instead of the coordinator's
        # orders (bytes_down), the orders sent again with the payloads in them after a pull failed, and the
        # sources the workers named as failed (served by another, or not at all)
        "bytes_pulled": sum(o.bytes_pulled for o in round_.outcomes),
        "relay_resent": sum(o.resent for o in round_.outcomes),
        "relay_failed": sum(len(o.unreachable) for o in round_.outcomes),  # (puller, source) pairs that failed
        "stragglers": sum(o.straggler for o in round_.outcomes),
        # where the senders' time went: their mean utilisation (None: none measured) and the seconds they
        # sat idle, summed over them, before this round's work began
        "utilisation": sum(shares.values()) / len(shares) if shares else None,
        "wait_s": sum(waited(r.timings) for r in usable),
        "worker_wall_s": sum(span(r.timings) for r in usable),
        "worker_utilisation": {w: round(u, 4) for w, u in shares.items()},
    }


class RunRecorder:
    """Where a run's records go, in order: ``metrics.jsonl``, the tracker (``--wandb-project``), and the
    progress display. ``close`` ends all three (the tracker with the run's exit code)."""

    def __init__(self, output_dir: Path | str, shown: Progress, tracker: Tracker | None = None) -> None:
        self.log = MetricsLog(output_dir)
        self.shown, self.tracker = shown, tracker

    def append(self, record: Mapping[str, Any]) -> None:
        self.log.append(record)
        if self.tracker is not None:
            self.tracker.log(record, step=int(record["step"]))
        self.shown.update(record)

    def close(self, exit_code: int) -> None:
        try:
            if self.tracker is not None:
                self.tracker.finish(exit_code=exit_code)
        finally:
            self.shown.close()
            self.log.close()
