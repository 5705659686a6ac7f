"""Workers that join a run themselves: `coordinator train --listen` and `worker serve --join`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradwire.coordinator.join import JoinRegistry, serve_joins
from gradwire.coordinator.metrics import read_metrics
from gradwire.security import ServerSecurity
from gradwire.transport import free_port
from gradwire.worker.joiner import Joiner, advertised_address

from .conftest import worker_process

TOKEN = "join-test-token-0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_registry_keeps_live_workers_in_join_order_and_drops_quiet_ones() -> None:
    clock = Clock()
    registry = JoinRegistry(expiry=30, clock=clock)
    assert registry.join("b:2") == (True, "") and registry.join("a:1") == (True, "")
    assert registry.poll() == ["b:2", "a:1"] and registry.poll() is None
    clock.now = 20
    registry.join("a:1")  # a repeats its Join; b goes quiet
    clock.now = 40
    assert registry.poll() == ["a:1"]
    assert registry.join("not an address")[0] is False and registry.join("x:99999")[0] is False
    registry.forget()
    assert registry.poll() == ["a:1"]


def test_a_joiner_needs_the_coordinators_token() -> None:
    registry = JoinRegistry()
    server, port = serve_joins(registry, host="127.0.0.1", port=0, security=ServerSecurity(token=TOKEN))
    try:
        stranger = Joiner(f"127.0.0.1:{port}", "127.0.0.1:7001", token=None)
        assert stranger.join_once() == stranger.every and stranger.joins == 0
        friend = Joiner(f"127.0.0.1:{port}", "127.0.0.1:7002", token=TOKEN)
        assert friend.join_once() == 5.0 and friend.joins == 1
        assert registry.live() == ["127.0.0.1:7002"]
        stranger.stop()
        friend.stop()
    finally:
        server.stop(0)


def test_advertised_address() -> None:
    assert advertised_address("127.0.0.1", 5000, None) == "127.0.0.1:5000"
    assert advertised_address("[::1]", 5000, None) == "[::1]:5000"
    assert advertised_address("[::]", 5000, "gpu1.example.org:6000") == "gpu1.example.org:6000"
    assert advertised_address("0.0.0.0", 5000, None).endswith(":5000")


@pytest.mark.slow
def test_workers_join_a_listening_coordinator_one_after_the_other(tmp_path: Path) -> None:
    listen, ports = free_port(), [free_port(), free_port()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "GRADWIRE_TOKEN": TOKEN}
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gradwire.coordinator",
        "train",
        "--listen",
        f"127.0.0.1:{listen}",
        "--model",
        "gpt-tiny",
        "--steps",
        "200",
        "--batch-size",
        "2",
        "--sequence-length",
        "32",
        "--output-dir",
        str(out),
        "--no-progress",
        "--checkpoint-every",
        "0",
    ]
    coordinator = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    workers = []
    os.environ["GRADWIRE_TOKEN"] = TOKEN  # the workers' token, from their environment
    try:
        workers.append(worker_process(ports[0], "--join", f"127.0.0.1:{listen}"))
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 5):
            assert coordinator.poll() is None and time.monotonic() < deadline, coordinator.communicate()[1][-3000:]
            time.sleep(0.1)
        workers.append(worker_process(ports[1], "--join", f"127.0.0.1:{listen}"))
        _, stderr = coordinator.communicate(timeout=300)
        assert coordinator.returncode == 0, stderr[-3000:]
    finally:
        os.environ.pop("GRADWIRE_TOKEN", None)
        if coordinator.poll() is None:
            coordinator.kill()
        for w in workers:
            w.terminate()
            w.wait(30)
    counts = [r["successful_workers"] for r in read_metrics(out)]
    assert counts[0] == 1 and counts[-1] == 2 and len(counts) == 200  # the second joined mid-run and stayed
    assert "joins the run" in stderr
