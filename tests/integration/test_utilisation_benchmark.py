"""benchmarks.utilisation at a tiny size: the bare loop and the service with 1 and 2 local workers, every
mode once, and the JSON holds every field with sane values."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import cores, utilisation

TOP = {
    "model",
    "parameters",
    "device",
    "device_name",
    "coordinator_device",
    "precision",
    "precision_reason",
    "batch_size",
    "seq_len",
    "steps",
    "rounds",
    "inner_steps",
    "warmup",
    "threads",
    "cores",
    "torch",
    "runs",
    "wall_s",
}
SECONDS = (
    "wall_s",
    "worker_compute_s",
    "worker_compute_per_step_s",
    "worker_replay_s",
    "worker_encode_s",
    "worker_wait_s",
    "worker_span_s",
    "coordinator_step_s",
    "coordinator_dispatch_s",
    "coordinator_aggregate_s",
)
# null until the coordinator's records hold them
MAYBE_SECONDS = ("coordinator_turnaround_s", "coordinator_background_s")
RUNS = ("bare", "grad-1", "grad-stream-1", "local-overlap-1", "grad-overlap-2", "local-2")


@pytest.mark.slow
def test_every_mode_runs_and_reports_every_figure(capsys: pytest.CaptureFixture) -> None:
    argv = ["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "2", "--rounds", "1"]
    assert utilisation.main([*argv, "--inner-steps", "2", "--runs", ",".join(RUNS), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == TOP
    assert result["device"] == result["coordinator_device"] == "cpu" and result["precision"] == "fp32"  # auto
    assert result["parameters"] > 0 and result["wall_s"] > 0 and result["cores"] is None  # all share every core
    runs = result["runs"]
    assert set(runs) == set(RUNS)
    bare = runs["bare"]
    assert bare["step_s"] > 0 and bare["tokens_per_sec"] > 0
    # measured again after the service: each run's ratio against both ends
    assert bare["after"]["tokens_per_sec"] > 0
    assert bare["drift"] == pytest.approx(bare["after"]["tokens_per_sec"] / bare["tokens_per_sec"])
    for name in RUNS[1:]:
        run = runs[name]
        assert "error" not in run, (name, run)
        local = name.startswith("local")
        assert run["workers"] == int(name[-1]) and run["per"] == ("round" if local else "step"), name
        assert run["inner_steps"] == (2 if local else 1) and run["rounds_timed"] == (1 if local else 2), name
        assert run["tokens_per_sec"] > 0 and run["of_bare"] > 0, name
        assert run["of_bare_after"] == pytest.approx(run["of_bare"] / bare["drift"]), name
        assert run["baseline"] == "1 x bare" and "share this machine's CPU" in run["baseline_reason"], name
        assert all(run[k] is not None and run[k] >= 0 for k in SECONDS), (name, run)
        assert run["worker_compute_s"] > 0 and run["coordinator_step_s"] > 0, name
        assert all(run[k] is None or run[k] >= 0 for k in MAYBE_SECONDS), (name, run)
        assert run["worker_utilisation"] is None or 0 <= run["worker_utilisation"] <= 1, name


@pytest.mark.slow
def test_the_llama_family_trains_through_the_service(capsys: pytest.CaptureFixture) -> None:
    # llama-tiny: llama-1b's architecture at a test's size, in local-SGD rounds as the GPU run takes llama-1b
    argv = ["--model", "llama-tiny", "--batch-size", "1", "--seq-len", "16", "--rounds", "1", "--inner-steps", "2"]
    assert utilisation.main([*argv, "--runs", "local-1", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"]["local-1"]
    assert "error" not in run, run
    assert run["tokens_per_sec"] > 0 and run["worker_compute_s"] > 0 and run["of_bare"] is None  # no bare loop


@pytest.mark.skipif(not cores.available() or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores")
def test_the_coordinator_and_the_workers_on_cores_of_their_own(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    service_run = utilisation.service_run

    def watched(*args, **kwargs):  # where every process runs as a service run starts
        workers = {pid: os.sched_getaffinity(pid) for pid in cores.descendants(os.getpid())}
        seen.append((os.sched_getaffinity(0), workers))
        return service_run(*args, **kwargs)

    monkeypatch.setattr(utilisation, "service_run", watched)
    before = os.sched_getaffinity(0)
    argv = ["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "2", "--inner-steps", "2"]
    assert utilisation.main([*argv, "--runs", "bare,grad-1", "--coordinator-cores", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    first, *rest = sorted(before)
    assert result["cores"] == {"coordinator": [first], "workers": rest}
    assert "error" not in result["runs"]["grad-1"] and result["runs"]["grad-1"]["of_bare"] > 0
    ((coordinator, workers),) = seen
    assert coordinator == {first} and workers and all(a == set(rest) for a in workers.values())
    assert os.sched_getaffinity(0) == before  # given back, and so are the processes started from here (a fork server)
    assert all(os.sched_getaffinity(pid) == before for pid in cores.descendants(os.getpid()))
