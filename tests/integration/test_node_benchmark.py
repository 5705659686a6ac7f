"""benchmarks.node's node-mode rows: each mode's round time, bus bytes, ranks' peak memory and first payload,
beside DDP's."""

from __future__ import annotations

import pytest

from benchmarks import node


@pytest.mark.slow
def test_the_node_benchmark_compares_each_mode_with_ddp() -> None:
    argv = ["--model", "gpt-tiny", "--ranks", "2", "--steps", "2", "--sequence-length", "32", "--hooks", ""]
    out = node.main([*argv, "--modes", "ddp,fsdp", "--json"])
    assert out["node"] == {} and set(out["modes"]) == {"ddp", "fsdp"}
    ddp, fsdp = out["modes"]["ddp"], out["modes"]["fsdp"]
    assert ddp["step_time_s"] > 0 and fsdp["step_time_s"] > 0 and ddp["step_time_vs_ddp"] == 1.0
    assert ddp["node_bytes_per_step"] > 0  # DDP's all-reduce; FSDP's collectives are not counted (see the module)
    assert len(fsdp["peak_rss_bytes_per_param"]) == 2 and all(b > 0 for b in fsdp["peak_rss_bytes_per_param"])
    # The same rows at the same version: the slow link carries the same payload whatever the mode.
    assert fsdp["payload_identical"] or fsdp["payload_max_abs_diff"] < 1e-4
    assert ddp["payload_identical"] and ddp["payload_max_abs_diff"] == 0.0


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        node.main(["--modes", "ddp,zero4"])
    assert "unknown node mode(s) zero4" in capsys.readouterr().err
