"""benchmarks.durable at a tiny size: its JSON has every field, the log costs about its updates' bytes, and a
resume replays every record it wrote."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import durable


def test_the_benchmark_reports_the_logs_bytes_appends_and_replay(monkeypatch, capsys: pytest.CaptureFixture) -> None:
    argv = ["durable", "--model", "gpt-tiny", "--rounds", "2", "--inner-steps", "2", "--replay-rounds", "6", "--json"]
    monkeypatch.setattr(sys, "argv", argv)
    durable.main()
    result = json.loads(capsys.readouterr().out)
    for mode in ("gradient", "local_sgd", "gossip_ring"):
        run = result["log"][mode]
        assert run["rounds"] == 2 and run["append_s"] > 0
        assert run["update_bytes"] < run["record_bytes"] <= 2 * run["update_bytes"]  # the target: at most 2x
        # a full checkpoint holds the model and every worker's state: more than a round's record
        assert run["checkpoint_s"] > 0 and run["checkpoint_bytes"] > run["record_bytes"]
    replay = result["replay"]
    assert replay["rounds"] == 6 and replay["resume_s"] == pytest.approx(replay["read_s"] + replay["apply_s"])
