"""benchmarks.chaos at a small size: kills, a stall and a join, and the run still completes every step once."""

from __future__ import annotations

import pytest

from benchmarks import chaos


@pytest.mark.slow
def test_a_small_chaos_run_completes_every_step_once(tmp_path) -> None:
    (tmp_path / "chaos").mkdir()
    result = chaos.run(rounds=16, chaos=True, kills=2, seed=1, directory=tmp_path / "chaos")
    assert result["steps_once"] and result["rounds_completed"] == 16 and result["kills"] == 2
    assert result["pushes"] <= 3 + 1 + 2  # first pushes, the joiner's, at most one per kill
    assert result["degraded_rounds"] >= 2  # the kills and the stall did cost rounds
