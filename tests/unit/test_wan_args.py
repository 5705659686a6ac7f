"""benchmarks.wan's command line (a misspelt method is refused before any host is made) and its comparison with DDP."""

import pytest

from benchmarks import wan


def test_unknown_method_is_refused_before_anything_runs(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        wan.main(["--methods", "ddp,gradwire-locl", "--json"])
    assert e.value.code == 2
    assert "unknown method 'gradwire-locl'" in capsys.readouterr().err


def test_bad_step_counts_are_refused_before_anything_runs(capsys: pytest.CaptureFixture) -> None:
    for flag in ("--steps", "--baseline-steps", "--inner-steps"):
        with pytest.raises(SystemExit) as e:
            wan.main([flag, "-3", "--json"])
        assert e.value.code == 2
        assert "must be >= 1" in capsys.readouterr().err


def test_loss_is_compared_only_after_equal_tokens() -> None:
    row = {"step_time": 3.0, "non_compute_time": 0.5, "bytes_per_step": 2e6, "eval_loss": 6.6}
    results = {
        "ddp": {
            "step_time": 12.0,
            "non_compute_time": 9.0,
            "bytes_per_step": 2.4e8,
            "eval_loss": 6.0,
            "tokens": 20_480,
        },
        "gradwire": {**row, "tokens": 20_480},
        "gradwire-local": {**row, "tokens": 40_960},  # run longer than the baseline (--baseline-steps)
        "flat": {
            **row,
            "non_compute_time": 0.01,
            "tokens": 20_480,
            "non_compute_measured": "separate steps",
        },  # ~0: no ratio
        "long-rounds": {**row, "non_compute_time": 0.02, "tokens": 20_480, "non_compute_measured": "same rounds"},
    }
    wan.compare_with_ddp(results)
    assert results["gradwire"]["non_compute_vs_ddp"] == 18.0 and results["gradwire"]["bytes_vs_ddp"] == 120.0
    assert abs(results["gradwire"]["loss_vs_ddp"] - 1.1) < 1e-12
    assert results["gradwire-local"]["non_compute_vs_ddp"] == 18.0 and results["gradwire-local"]["loss_vs_ddp"] is None
    assert results["flat"]["non_compute_vs_ddp"] is None  # under 1% of its step, from separate compute steps
    assert results["long-rounds"]["non_compute_vs_ddp"] == 450.0  # as small, but measured in the same rounds
    assert results["ddp"]["loss_vs_ddp"] == 1.0
