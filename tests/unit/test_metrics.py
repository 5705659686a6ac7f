"""Metrics: the JSON-lines log (required keys, appending across runs, strict JSON) and the progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gradwire.coordinator.metrics import METRIC_KEYS, MetricsLog, ProgressBar, read_metrics


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
