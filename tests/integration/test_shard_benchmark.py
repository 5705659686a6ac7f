"""benchmarks.shard prints one JSON object comparing each node mode's state per rank with DDP's."""

from __future__ import annotations

import json

import pytest

from benchmarks import shard


@pytest.mark.slow
def test_the_shard_benchmark_compares_modes_with_ddp(capsys: pytest.CaptureFixture) -> None:
    assert shard.main(["--model", "gpt-tiny", "--rounds", "1", "--seq-len", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"ddp", "fsdp", "pipeline"} and out["ranks"] == 2
    ddp, fsdp, pipe = out["modes"]["ddp"], out["modes"]["fsdp"], out["modes"]["pipeline"]
    assert ddp["state_vs_ddp"] == 1.0 and 0.5 < fsdp["state_vs_ddp"] < 1.0  # gpt-tiny: one big tensor
    # gpt-tiny's tied embedding (86% of it) lives on both stages of a pipeline
    assert 0.5 < pipe["state_vs_ddp"] < 1.0
    for mode in (fsdp, pipe):
        assert all(b > 0 for b in mode["state_bytes_per_parameter_per_rank"]) and mode["round_seconds_median"] > 0


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        shard.main(["--modes", "ddp,zero4"])
    assert "unknown node mode(s) zero4" in capsys.readouterr().err
