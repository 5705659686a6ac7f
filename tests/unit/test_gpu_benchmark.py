"""benchmarks.gpu: every check runs here CPU against CPU (what a GPU run compares across devices), and
without CUDA the command says so and exits 0."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu
from gradwire.models import build_from_spec, model_spec

SPEC = model_spec("gpt-tiny")


@pytest.mark.parametrize("config", [gpu.TOP_K, gpu.LOW_RANK], ids=["top-k", "low-rank"])
def test_the_codec_check_decodes_one_payload_alike_and_matches_the_cpu_worker(config) -> None:
    out = gpu.check_codec(SPEC, "cpu", config)
    assert out["payload_bytes"] > 0
    assert out["decode_cpu_vs_device_max_abs"] == 0.0
    assert out["device_vs_cpu_worker_cosine"] == pytest.approx(1.0, abs=1e-9)


def test_the_autocast_check_compares_bf16_with_float32_gradients() -> None:
    out = gpu.check_autocast(SPEC, "cpu")
    assert 0.99 < out["cosine"] <= 1.0 + 1e-12 and 0.0 < out["relative_l2_error"] < 0.1  # bf16 is not exact


def test_the_muon_check_compares_a_step_with_the_float32_iteration() -> None:
    out = gpu.check_muon("cpu", shape=(32, 48))
    assert out["cosine"] > 0.999 and out["shape"] == [32, 48]


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("config", [gpu.TOP_K, gpu.LOW_RANK], ids=["top-k", "low-rank"])
def test_replicas_on_one_device_kind_replay_without_drift(exact: bool, config) -> None:
    out = gpu.check_drift(SPEC, "cpu", "cpu", updates=3, exact=exact, config=config)
    assert out == {"updates": 3, "max_abs_difference": 0.0, "equal": True}


def test_drift_is_measured_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A replica that steps differently must show up: the check reads the parameters, it does not trust them.
    real = gpu.Replica.apply
    calls = {"n": 0}

    def apply(self, update, *args, **kwargs):
        calls["n"] += 1
        out = real(self, update, *args, **kwargs)
        if calls["n"] % 2 == 0:  # the second replica of each update
            next(iter(self.params.values())).data.add_(1e-3)
        return out

    monkeypatch.setattr(gpu.Replica, "apply", apply)
    out = gpu.check_drift(SPEC, "cpu", "cpu", updates=2, exact=True)
    assert not out["equal"] and out["max_abs_difference"] == pytest.approx(2e-3, rel=1e-3)


def test_without_cuda_it_says_so_and_exits_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"cuda": False, "reason": "no CUDA device: nothing to check"}


def test_a_run_reports_every_check_and_a_failed_check_as_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "check_muon", lambda device: 1 / 0)
    out = gpu.run("gpt-tiny", "cpu", updates=2)
    assert out["node"] == {"skipped": "needs two GPUs"} or "max_abs_difference" in out["node"]
    assert out["muon"] == {"error": "ZeroDivisionError: division by zero"}
    assert out["drift_float64"]["equal"] and out["codec"]["decode_cpu_vs_device_max_abs"] == 0.0
    assert all("seconds" in out[k] for k in ("codec", "autocast", "drift_float32", "drift_float64", "stream"))


@pytest.mark.slow
def test_the_node_check_compares_a_node_with_one_device() -> None:
    out = gpu.check_node(SPEC, "cpu", modes=("pipeline",))  # every mode's node is checked so in tests/integration
    assert set(out) == {"pipeline_max_abs_difference"} and 0.0 <= out["pipeline_max_abs_difference"] < 1e-4


@pytest.mark.slow
def test_the_memory_check_reports_each_modes_state_beside_ddps() -> None:
    out = gpu.check_memory("gpt-tiny", "cpu", modes="ddp,pipeline")
    assert set(out) == {"ddp", "pipeline"} and out["ddp"]["state_vs_ddp"] == 1.0
    assert 0.5 < out["pipeline"]["state_vs_ddp"] < 1.0


def test_the_stream_check_times_whole_and_streamed_rounds_and_compares_their_payloads() -> None:
    out = gpu.check_stream(SPEC, "cpu", rounds=2, rows=2)
    assert "bf16_whole_ms" not in out  # bf16 autocast only on a GPU
    for how in ("whole", "streamed"):
        timed = out[f"fp32_{how}_ms"]
        assert set(timed) == {"compute", "compress", "total"} and timed["total"] >= timed["compute"] > 0
    # on a CPU the pieces are the payload, byte for byte, and a second whole run is the first
    assert out["fp32_streamed_vs_whole_max_abs"] == out["fp32_whole_again_vs_whole_max_abs"] == 0.0


def test_checks_runs_the_named_checks_alone() -> None:
    out = gpu.run("gpt-tiny", "cpu", updates=1, only=("muon", "node"))
    assert set(out) == {"model", "device", "torch", "muon", "node"}
    assert out["node"] == {"skipped": "needs two GPUs"} or "max_abs_difference" in out["node"]
    assert gpu.main.__module__ == "benchmarks.gpu" and "llama-1b" in gpu.model_names()  # --model llama-1b parses
    with pytest.raises(SystemExit):
        gpu.main(["--checks", "muon,warp"])


def test_the_refine_check_times_both_thin_qrs_on_the_models_stacks_and_compares_what_they_send() -> None:
    out = gpu.check_refine("gpt-tiny", "cpu", repeats=2)
    assert out["default"] == "householder"  # a CPU's; a GPU's is cholesky
    assert out["stacks"] >= 2 and out["matrices"] >= out["stacks"]
    assert out["householder_ms"] > 0 and out["cholesky_ms"] > 0
    assert out["householder_launches"] > 0 and out["cholesky_launches"] > 0
    assert 0.0 < out["max_rel_diff"] < 1e-4  # the same factors but for rounding (and the fill)


def test_the_fingerprint_check_times_both_ways_and_compares_with_the_cpu() -> None:
    out = gpu.check_fingerprint(SPEC, "cpu", repeats=2)
    assert out["tensors"] == len(list(build_from_spec(SPEC, 0).parameters())) and out["slabs"] >= 1
    assert out["samples_equal"] is True and out["max_rel_diff_vs_cpu"] < 1e-12
    assert out["planned_ms"] > 0 and out["per_tensor_ms"] > 0 and out["samples_only_ms"] > 0
    # The plan's work does not grow with the tensors: a few operators a slab, not a few a tensor.
    assert out["planned_launches"] < out["per_tensor_launches"]
