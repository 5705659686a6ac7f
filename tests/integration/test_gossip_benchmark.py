"""The gossip benchmarks at toy size: ``benchmarks.quality``'s gossip rows against the centralized round at
the same H, and ``benchmarks.gossip`` (the seed experiment's config) on every graph, plotted."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # these tests train for seconds each

_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    # benchmarks/ is not an installed package: load the module from its file, whatever the working directory.
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", _ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_gossip_rows_report_their_gap_to_the_centralized_round_and_their_downlink(tmp_path):
    quality = _load("quality")
    args = ["--model", "gpt-tiny", "--steps-total", "4", "--inner-steps", "2", "--batch-size", "2"]
    args += ["--sequence-length", "32", "--workers", "4", "--output-dir", str(tmp_path), "--json"]
    result = quality.main([*args, "--methods", "averaging,gossip-ring,gossip-complete"])
    averaging, ring, complete = (result["methods"][m] for m in ("averaging", "gossip-ring", "gossip-complete"))
    for r in (ring, complete):
        assert r["tokens"] == averaging["tokens"] and r["inner_steps"] == averaging["inner_steps"] == 2
        assert r["gap_vs_centralized"] == (r["eval_loss"] - averaging["eval_loss"]) / averaging["eval_loss"]
        assert math.isfinite(r["consensus_distance"]) and r["bytes_down_per_worker_round"] > 0
    assert ring["relayed_payloads_max"] == 2 and complete["relayed_payloads_max"] == 3  # degree, of 4 workers
    assert ring["target_gap_vs_centralized"] == math.inf and complete["target_gap_vs_centralized"] == 0.005


def test_the_seed_experiment_runs_on_every_graph_and_is_plotted(tmp_path):
    gossip = _load("gossip")
    seed = yaml.safe_load((_ROOT / "configs" / "gossip-ring.yaml").read_text())
    assert (seed["local"], seed["model"], seed["topology"], seed["sequence_length"]) == (8, "gpt-2x256", "ring", 64)
    assert (seed["inner_optimizer"], seed["inner_learning_rate"], seed["inner_momentum"]) == ("demuon", 0.1, 0.8)
    assert (seed["msgn"], seed["inner_lr_schedule"]) == ("newton-schulz", "constant")
    small = {**seed, "local": 4, "model": "gpt-tiny", "batch_size": 2, "sequence_length": 32}
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(small))
    plot = tmp_path / "gossip.png"
    out = gossip.main(["--config", str(config), "--steps", "3", "--eval-every", "3", "--plot", str(plot)])
    out = out["results"]
    assert set(out) == {"ring", "exponential", "complete"}
    assert [out[g]["degree_max"] for g in ("ring", "exponential", "complete")] == [2, 3, 3]
    assert all(math.isfinite(r["final_eval_loss"]) and r["rounds"] == 3 for r in out.values())
    assert plot.stat().st_size > 0
    # The ring again, its messages pulled worker to worker (in this process): the same run, and the
    # coordinator's bytes to a worker drop by the two messages it pulled instead.
    p2p = gossip.main(
        ["--config", str(config), "--steps", "3", "--eval-every", "3", "--graphs", "ring", "--peer-to-peer"]
    )
    ring, ours = out["ring"], p2p["results"]["ring"]
    assert ours["final_eval_loss"] == ring["final_eval_loss"] and ring["peer_bytes_down_per_worker_round"] == 0
    pulled = ours["peer_bytes_down_per_worker_round"]
    assert pulled > 0 and ours["bytes_down_per_worker_round"] < ring["bytes_down_per_worker_round"] - 0.9 * pulled
