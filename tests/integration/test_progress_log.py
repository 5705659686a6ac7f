"""A run whose stderr is not a terminal (nohup, a CI log, ``docker logs``) shows its progress as it goes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

PROGRESS = re.compile(
    r"step (\d+)/400 \| loss [\d.]+ \| [\d,]+ tok/s \| up [\d.]+ [KMG]?B, down [\d.]+ [KMG]?B \| ETA "
)


@pytest.mark.slow
def test_progress_lines_reach_a_log_file_before_the_run_ends(tmp_path) -> None:
    log = tmp_path / "stderr.log"
    argv = [
        sys.executable,
        "-m",
        "gradwire.coordinator",
        "train",
        "--local",
        "1",
        "--model",
        "gpt-tiny",
        "--steps",
        "400",
        "--batch-size",
        "2",
        "--sequence-length",
        "32",
        "--checkpoint-every",
        "0",
        "--log-every",
        "0.5",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        deadline, lines = time.monotonic() + 180, []
        while time.monotonic() < deadline and len(lines) < 2 and proc.poll() is None:
            lines = [m for m in map(PROGRESS.search, log.read_text().splitlines()) if m]
            time.sleep(0.2)
        running = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)  # finishes the round in flight, checkpoints, stops its worker
        proc.wait(timeout=120)
    assert running, f"the run ended before two progress lines appeared:\n{log.read_text()[-2000:]}"
    steps = [int(m.group(1)) for m in lines]
    assert len(steps) >= 2 and steps[0] < steps[1] < 400  # lines as it goes, with the step moving on
    final = [m for m in map(PROGRESS.search, log.read_text().splitlines()) if m]
    assert int(final[-1].group(1)) >= steps[-1]  # and a last one when the run stops
