"""The run report: three PNG charts drawn from metrics.jsonl, and clear errors when there is nothing to draw."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gradwire.coordinator import cli
from gradwire.coordinator.metrics import METRIC_KEYS, METRICS_FILE, MetricsLog
from gradwire.coordinator.report import COMPARE_FILE, REPORT_FILES, write_comparison, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_run(
    output_dir: Path, steps: int, *, eval_every: int = 0, first_step: int = 1, bytes_up: int = 2 * 3_000
) -> None:
    """A plausible log: decaying loss, a state push on step 1, compute inside the dispatch."""
    with MetricsLog(output_dir) as log:
        for step in range(first_step, first_step + steps):
            compute, aggregate = 0.08 + 0.001 * (step % 7), 0.02
            dispatch = compute + 0.03 + (0.5 if step == 1 else 0.0)
            record = {
                "step": step,
                "loss": 3.0 + 6.0 * math.exp(-step / 20) + 0.05 * math.sin(step),
                "grad_norm": 1.0,
                "tokens_per_sec": 5000.0,
                "compression_ratio": 200.0,
                "bytes_up": bytes_up,
                "bytes_down": 2 * (2_400_000 if step == 1 else 3_000),
                "step_time": dispatch + aggregate,
                "dispatch_time": dispatch,
                "aggregate_time": aggregate,
                "successful_workers": 2,
                "total_tokens": 1024 * step,
                "lr": 1e-3,
                "worker_compute_time": compute,
            }
            if eval_every and step % eval_every == 0:
                record["eval_loss"] = record["loss"] + 0.1
            log.append(record)


def assert_pngs(paths: list[Path], where: Path) -> None:
    assert [p.name for p in paths] == list(REPORT_FILES)
    for path in paths:
        assert path.parent == where and path.is_file()
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC, path
        assert len(data) > 10_000, f"{path.name} is only {len(data)} bytes: an empty chart?"


@pytest.mark.parametrize(("steps", "eval_every"), [(30, 0), (120, 20)])  # bars and stacked areas
def test_writes_three_pngs(tmp_path: Path, steps: int, eval_every: int) -> None:
    synthetic_run(tmp_path, steps, eval_every=eval_every)
    assert_pngs(write_report(tmp_path), tmp_path)


def test_resumed_and_odd_logs_still_draw(tmp_path: Path) -> None:
    # A resumed run re-logs steps 10..19; an older log lacks worker_compute_time; a diverged step logs null.
    synthetic_run(tmp_path, 20)
    synthetic_run(tmp_path, 15, first_step=10)
    diverged = {key: 1 for key in METRIC_KEYS} | {
        "step": 25,
        "loss": float("nan"),
        "step_time": 0.1,
        "dispatch_time": 0.08,
        "aggregate_time": 0.02,
    }
    with MetricsLog(tmp_path) as log:
        log.append(diverged)
    report = tmp_path / "report"
    assert_pngs(write_report(tmp_path, report), report)


def test_a_single_step_draws(tmp_path: Path) -> None:
    synthetic_run(tmp_path, 1)
    assert_pngs(write_report(tmp_path), tmp_path)


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"no {METRICS_FILE} in .*--output-dir"):
        write_report(tmp_path)
    (tmp_path / METRICS_FILE).write_text("\n")
    with pytest.raises(ValueError, match="no metrics records"):
        write_report(tmp_path)
    assert not list(tmp_path.glob("*.png"))


def test_several_runs_compare_their_last_loss_against_their_uplink_bytes_per_token(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dense, compressed = tmp_path / "dense", tmp_path / "compressed"
    synthetic_run(dense, 30, eval_every=10, bytes_up=2 * 40_000)
    synthetic_run(compressed, 30, bytes_up=2 * 10)  # no held-out loss: its training loss stands in
    path, runs = write_comparison([dense, compressed], tmp_path / "out")
    assert path == tmp_path / "out" / COMPARE_FILE and path.read_bytes()[:8] == PNG_MAGIC
    assert [(r.name, r.held_out, r.steps) for r in runs] == [("dense", True, 30), ("compressed", False, 30)]
    assert runs[0].bytes_up_per_token == pytest.approx(30 * 80_000 / (1024 * 30))
    assert runs[1].bytes_up_per_token == pytest.approx(30 * 20 / (1024 * 30))
    assert runs[0].loss == pytest.approx(3.0 + 6.0 * math.exp(-30 / 20) + 0.05 * math.sin(30) + 0.1)
    # The command: each run's charts in its own directory, the comparison where asked, a line per run.
    assert cli.report([str(dense), str(compressed)], str(tmp_path / "both")) == 0
    printed = capsys.readouterr().out.splitlines()
    assert str(tmp_path / "both" / COMPARE_FILE) in printed and str(dense / "loss.png") in printed
    assert printed[-2].startswith("dense: held-out loss ") and printed[-1].startswith("compressed: training loss ")
    assert cli.report([str(dense), str(tmp_path / "nowhere")]) == 2
