"""benchmarks.wan at a tiny size over shaped links between namespaces (root; skipped elsewhere): every
method runs on the same hosts, bytes come from the interface counters, and gradwire's gradient mode puts
fewer bytes on the wire per step than DDP's all-reduce."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import wan
from benchmarks.netns import root_available
from benchmarks.wire import tun_available

OK, WHY = root_available()
EVERY_LINK = [m for m in wan.METHODS if m != "gradwire-relayed"]  # that one: the coordinator's link test below


@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=WHY)
def test_every_method_runs_over_the_shaped_links(capsys: pytest.CaptureFixture) -> None:
    latency = "25ms" if tun_available()[0] else "0"  # user-space latency needs TUN interfaces
    assert (
        wan.main(
            [
                "--model",
                "gpt-tiny",
                "--steps",
                "4",
                "--inner-steps",
                "2",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--bandwidth",
                "50mbit",
                "--latency",
                latency,
                "--methods",
                ",".join(EVERY_LINK),
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    methods = result["methods"]
    assert set(methods) == set(EVERY_LINK)
    for name, r in methods.items():
        assert r["bytes_per_step"] > 0 and math.isfinite(r["eval_loss"]) and r["step_time"] > 0, name
    assert (
        methods["ddp"]["tokens"]
        == methods["gradwire"]["tokens"]
        == methods["gradwire-overlap"]["tokens"]
        == methods["gradwire-stream"]["tokens"]
        == methods["gradwire-local"]["tokens"]
        == methods["gradwire-local-overlap"]["tokens"]
        == methods["gradwire-fragments"]["tokens"]
    )
    assert methods["gradwire"]["bytes_per_step"] < methods["ddp"]["bytes_per_step"]
    # The streamed gradient is the same payload in pieces: the same training, about the same bytes.
    stream, whole = methods["gradwire-stream"], methods["gradwire"]
    assert math.isclose(stream["eval_loss"], whole["eval_loss"], rel_tol=1e-3)
    assert 0.9 < stream["bytes_per_step"] / whole["bytes_per_step"] < 1.2
    for name in ("gradwire", "gradwire-overlap", "gradwire-stream"):  # non-compute time, in parts that add up
        r = methods[name]
        assert r["replay_time"] > 0 and r["encode_time"] > 0 and r["aggregate_time"] > 0, name
        assert math.isclose(
            r["replay_time"] + r["encode_time"] + r["aggregate_time"] + r["link_time"],
            r["non_compute_time"],
            rel_tol=1e-9,
        ), name
    for name, timed in (
        ("gradwire", 3),
        ("gradwire-overlap", 3),
        ("gradwire-stream", 3),
        ("gradwire-local", 1),
        ("gradwire-local-overlap", 1),
        ("gradwire-fragments", 3),  # rounds of H / F = 1 step
    ):  # round by round, round 1 left out
        r = methods[name]
        assert (
            len(r["rounds_non_compute_time"]) == len(r["rounds_replay_time"]) == len(r["rounds_encode_time"]) == timed
        ), name
        assert all(t > 0 for t in r["rounds_replay_time"] + r["rounds_encode_time"]), name
    local = methods["gradwire-local"]
    assert math.isclose(local["rounds_non_compute_time"][0], local["non_compute_time"], rel_tol=1e-9)
    fragments, local = methods["gradwire-fragments"], methods["gradwire-local"]
    # each tensor syncs once every H steps either way: about the same bytes per step, in rounds of 1/F of them
    assert 0.5 < fragments["bytes_per_step"] / local["bytes_per_step"] < 2
    for name in ("gradwire", "gradwire-local", "gradwire-local-overlap"):  # each worker's own account of its time
        r = methods[name]
        assert 0 < r["utilisation"] <= 1 and len(r["worker_utilisation"]) == 2, name
        assert 0 <= r["wait_fraction"] < 1 and len(r["rounds_wait_fraction"]) == len(r["rounds_replay_time"]), name


@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=WHY)
def test_behind_a_slow_link_the_relayed_coordinator_sends_no_payload(capsys: pytest.CaptureFixture) -> None:
    """Three workers on a fast network, the coordinator's link alone shaped: relayed, its host sends the
    orders without the payloads (each order carried the two other workers' before), and training is the same."""
    latency = "25ms" if tun_available()[0] else "0"
    argv = ["--model", "gpt-tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--workers", "3"]
    argv += ["--bandwidth", "50mbit", "--latency", latency, "--topology", "coordinator-link"]
    assert wan.main([*argv, "--methods", "gradwire,gradwire-relayed", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    direct, relayed = result["methods"]["gradwire"], result["methods"]["gradwire-relayed"]
    assert result["topology"] == "coordinator-link"
    assert direct["eval_loss"] == relayed["eval_loss"] and direct["tokens"] == relayed["tokens"]
    assert relayed["coordinator_bytes_per_step"] < direct["coordinator_bytes_per_step"] / 3


def test_without_namespaces_it_says_why_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(wan, "root_available", lambda: (False, "network namespaces need root"))
    assert wan.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "skipped": "benchmarks.wan needs network namespaces: network namespaces need root"
    }


def test_latency_without_tun_interfaces_says_why_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(wan, "root_available", lambda: (True, ""))
    monkeypatch.setattr(wan, "tun_available", lambda: (False, "/dev/net/tun is missing (the tun kernel module)"))
    assert wan.main(["--latency", "10ms", "--json"]) == 0
    skipped = json.loads(capsys.readouterr().out)["skipped"]
    assert "/dev/net/tun is missing" in skipped and "--latency 0" in skipped
