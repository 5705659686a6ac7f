"""benchmarks.e2e: the service beside a bare step, at a tiny size, with a setting passed through."""

from __future__ import annotations

import pytest

from benchmarks import e2e


def test_the_service_and_the_bare_step_are_timed_side_by_side_with_the_settings_given() -> None:
    argv = ["--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--json"]
    result = e2e.main([*argv, "--set", "stream_buckets=2", "--set", "replay_precision=float32"])
    assert result["settings"] == {"stream_buckets": 2, "replay_precision": "float32"}
    assert result["bare_step_s"] > 0 and result["service_step_s"] > 0
    assert result["step_time_ratio"] == pytest.approx(result["service_step_s"] / result["bare_step_s"])
    assert 0 < result["bytes_up_per_step"] < result["state_bytes"]  # a compressed gradient, not the model


def test_a_setting_that_is_not_a_field_is_refused() -> None:
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        e2e.main(["--model", "gpt-tiny", "--set", "no_such_field=1"])
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        e2e.main(["--model", "gpt-tiny", "--set", "stream_buckets"])
