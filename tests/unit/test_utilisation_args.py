"""benchmarks.utilisation without running it: its sizes by device, ``--runs``, and how a run's records
become its figures (``summarize``, pure)."""

from __future__ import annotations

import pytest

from benchmarks import utilisation


def test_the_cpu_default_is_gpt_80m_at_one_row_of_64_tokens() -> None:
    args = utilisation.parse_args([])
    assert (args.model, args.batch_size, args.seq_len, args.inner_steps) == ("gpt-80m", 1, 64, 30)
    assert args.runs == utilisation.RUNS and args.device == "cpu" and args.precision == "auto"
    quick = utilisation.parse_args(["--quick", "--steps", "3"])
    assert (quick.model, quick.steps, quick.inner_steps) == ("gpt-tiny", 3, 2)  # a flag given wins


def test_runs_are_named_and_checked() -> None:
    assert utilisation.RUNS == (
        "bare",
        "grad-1",
        "grad-overlap-1",
        "grad-stream-1",
        "local-1",
        "local-overlap-1",
        "grad-2",
        "grad-overlap-2",
        "grad-stream-2",
        "local-2",
        "local-overlap-2",
    )
    assert utilisation.parse_args(["--runs", "bare, local-1"]).runs == ("bare", "local-1")
    with pytest.raises(SystemExit):
        utilisation.parse_args(["--runs", "bare,grad-3"])
    with pytest.raises(SystemExit):
        utilisation.parse_args(["--inner-steps", "1", "--runs", "local-1"])


def _record(total_tokens: int, **values: float) -> dict:
    base = {
        "total_tokens": total_tokens,
        "successful_workers": 2,
        "worker_compute_time": 1.0,
        "worker_update_time": 0.1,
        "worker_compress_time": 0.2,
        "wait_s": 0.6,  # summed over the 2 senders
        "worker_wall_s": 3.0,
        "utilisation": 0.7,
        "step_time": 1.5,
        "dispatch_time": 1.4,
        "aggregate_time": 0.1,
    }
    return {**base, **values}


def test_summarize_leaves_out_the_warm_up_and_counts_tokens_by_the_wall_clock() -> None:
    rounds = [
        (_record(100, worker_compute_time=50.0), 60.0),  # the state push: left out
        (_record(300, turnaround_s=0.02), 2.0),
        (_record(500, turnaround_s=0.04), 2.0),
    ]
    out = utilisation.summarize(rounds, 1, workers=2, inner_steps=30, bare={"tokens_per_sec": 50.0}, baseline=1)
    assert out["tokens_per_sec"] == 100.0 and out["of_bare"] == 2.0 and out["baseline"] == "1 x bare"
    assert out["rounds_timed"] == 2 and out["per"] == "round"
    assert out["worker_compute_s"] == 1.0 and out["worker_compute_per_step_s"] == pytest.approx(1 / 30)
    assert out["worker_wait_s"] == pytest.approx(0.3) and out["worker_span_s"] == 1.5  # per worker
    assert out["coordinator_turnaround_s"] == pytest.approx(0.03)
    assert out["coordinator_background_s"] is None  # records that do not hold it


def test_summarize_against_two_bare_loops_and_without_one() -> None:
    rounds = [(_record(100), 1.0), (_record(200), 1.0)]
    out = utilisation.summarize(rounds, 0, workers=2, inner_steps=1, bare={"tokens_per_sec": 50.0}, baseline=2)
    assert out["tokens_per_sec"] == 100.0 and out["of_bare"] == 1.0 and out["baseline"] == "2 x bare"
    assert out["per"] == "step"
    assert utilisation.summarize(rounds, 0, 2, 1, None, 2)["of_bare"] is None
