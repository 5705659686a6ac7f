"""Per-step metrics: one JSON line per step in ``<output_dir>/metrics.jsonl``, and a terminal progress bar.

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
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

__all__ = ["METRIC_KEYS", "METRICS_FILE", "MetricsLog", "ProgressBar", "read_metrics"]

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
