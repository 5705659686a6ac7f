"""benchmarks.stages at a tiny size: every stage of both modes is timed on the thread that runs it, the
heavy ones are called again alone, and the stage functions are left as they were."""

from __future__ import annotations

import json

import pytest

from benchmarks import stages
from gradwire.replica import Replica
from gradwire.worker import rounds


def test_quick_stages_report_each_stage_by_thread_and_the_heavy_ones_alone(capsys: pytest.CaptureFixture) -> None:
    originals = [owner.__dict__[name] for owner, name, _ in stages.STAGES]
    assert stages.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "gpt-tiny" and set(out["modes"]) == {"gradient", "local"}
    for mode, figures in out["modes"].items():
        assert figures["round_ms"] > 0
        seen = {(r["stage"], r["thread"]) for r in figures["stages"]}
        # The worker computes and encodes on its round thread, takes its fingerprint ahead on another, and
        # the coordinator's replica applies each update on its own.
        for expected in (("compute", "compute"), ("encode", "compute"), ("replica fingerprint", "ahead")):
            assert expected in seen, (mode, expected, seen)
        assert ("replica apply", "replica") in seen
        assert ("coordinator: aggregate's norm", "main") in seen  # the norm a round reports, on its critical path
        assert all(r["calls_per_round"] > 0 and r["per_round_ms"] >= r["median_ms"] * 0.999 for r in figures["stages"])
        per_round = [r["per_round_ms"] for r in figures["stages"]]
        assert per_round == sorted(per_round, reverse=True)
        assert set(figures["alone"]) == {"fingerprint", "compute", "encode", "decode own payload"}
        assert all(v["median_ms"] > 0 and v["launches"] > 0 for v in figures["alone"].values())
    assert out["modes"]["local"]["inner_steps"] == 2
    # Unwrapped afterwards: the next run in this process times nothing.
    assert [owner.__dict__[name] for owner, name, _ in stages.STAGES] == originals
    assert "apply" in Replica.__dict__ and rounds.decode_ahead.__name__ == "decode_ahead"


def test_thread_roles_and_arguments() -> None:
    assert [stages.thread_role(n) for n in ("gradwire-compute_0", "gradwire-ahead_0", "dispatch_3", "x")] == [
        "compute",
        "ahead",
        "dispatch",
        "main",
    ]
    args = stages.parse_args([])
    assert (args.model, args.batch_size, args.seq_len, args.inner_steps) == stages.CPU_SIZE
    with pytest.raises(SystemExit):
        stages.parse_args(["--modes", "gossip"])
