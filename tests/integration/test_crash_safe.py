"""The coordinator as a process that is interrupted: SIGINT finishes the round, checkpoints, closes the
workers' sessions and exits 0 with the command that resumes; SIGKILL at any moment leaves a checkpoint to
resume from. Either way the resumed run follows the uninterrupted one and metrics.jsonl holds each step once."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
STEPS = 16
TRAIN = [
    "--local",
    "2",
    "--model",
    "gpt-tiny",
    "--steps",
    str(STEPS),
    "--batch-size",
    "4",
    "--sequence-length",
    "32",
    "--no-progress",
    "--checkpoint-every",
    "3",
    "--balance",
    "off",  # shares sized to each run's own timings would differ between the runs compared
]


def coordinator(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradwire.coordinator", "train", *args]


def steps_and_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def start_and_wait_for(argv: list[str], out: Path, records: int) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= records):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = subprocess.run(
        coordinator(*TRAIN, "--output-dir", str(out)), capture_output=True, text=True, timeout=300, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return steps_and_losses(out)


@pytest.mark.slow
def test_sigint_checkpoints_exits_0_and_says_how_to_resume(
    tmp_path: Path, uninterrupted: list[tuple[int, float]]
) -> None:
    out = tmp_path / "run"
    proc = start_and_wait_for(coordinator(*TRAIN, "--output-dir", str(out)), out, 5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    (line,) = [line for line in stdout.splitlines() if "Resume with:" in line]
    assert "Traceback" not in stderr
    stopped = len(steps_and_losses(out))
    assert 5 <= stopped < STEPS and f"stopped at step {stopped} of {STEPS}" in line
    command = shlex.split(line.split("Resume with: ", 1)[1])
    assert command[0] == "coordinator" and command[-2:] == ["--resume-from", str(out / "checkpoints")]
    resumed = subprocess.run(
        [sys.executable, "-m", "gradwire.coordinator", *command[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps_and_losses(out) == uninterrupted  # each step once, the same trajectory


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_repeats_nothing_and_loses_nothing(
    tmp_path: Path, uninterrupted: list[tuple[int, float]]
) -> None:
    out = tmp_path / "run"
    proc = start_and_wait_for(coordinator(*TRAIN, "--output-dir", str(out), "--checkpoint-every", "1"), out, 7)
    proc.send_signal(signal.SIGKILL)  # checkpoints every step: often mid-checkpoint
    proc.communicate(timeout=60)
    written = len(steps_and_losses(out))
    # A new run into the same directory is refused; resuming it is not.
    refused = subprocess.run(
        coordinator(*TRAIN, "--output-dir", str(out)), capture_output=True, text=True, timeout=120, env=ENV
    )
    assert refused.returncode == 2 and "already holds a run" in refused.stderr and "--resume-from" in refused.stderr
    resumed = subprocess.run(
        coordinator(*TRAIN, "--output-dir", str(out), "--resume-from", str(out / "checkpoints")),
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert written >= 7 and steps_and_losses(out) == uninterrupted
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_a_stop_request_finishes_the_round_checkpoints_and_closes_the_sessions(tmp_path: Path) -> None:
    from gradwire.coordinator.checkpoint import load_checkpoint
    from gradwire.coordinator.config import TrainConfig
    from gradwire.coordinator.trainer import Trainer

    from .conftest import live_workers

    with live_workers(2) as workers:
        trainer = Trainer(
            TrainConfig(model="gpt-tiny", steps=10, batch_size=2, sequence_length=32, output_dir=str(tmp_path)),
            [w.client() for w in workers],
            progress=False,
        )
        step = trainer.train_step

        def stop_after_3() -> dict | None:
            record = step()
            if trainer.step == 3:
                trainer.request_stop()  # as the SIGINT handler does, mid-round
            return record

        trainer.train_step = stop_after_3
        try:
            trainer.run()
        finally:
            trainer.close()
        assert trainer.interrupted and trainer.step == 3
        assert all(w.engine.sessions == {} for w in workers)  # closed on the workers
        _, meta = load_checkpoint(trainer.last_checkpoint)
        assert meta["step"] == 3 and not (tmp_path / "final").exists()


@pytest.mark.slow
def test_the_run_survives_every_worker_being_killed_and_restarted(tmp_path: Path) -> None:
    from gradwire.transport import free_port

    ports = [free_port() for _ in range(2)]

    from .conftest import worker_process

    workers = [worker_process(p) for p in ports]
    out = tmp_path / "run"
    try:
        argv = coordinator(
            "--workers",
            ",".join(f"127.0.0.1:{p}" for p in ports),
            *TRAIN[2:],
            "--output-dir",
            str(out),
            "--steps",
            "20",
            "--round-timeout",
            "10",
        )
        proc = start_and_wait_for(argv, out, 4)
        for w in workers:
            w.kill()
            w.wait(10)
        time.sleep(2.0)  # every worker down: rounds fail and back off instead of ending the run
        workers = [worker_process(p) for p in ports]
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    finally:
        for w in workers:
            w.kill()
            w.wait(10)
    assert [s for s, _ in steps_and_losses(out)] == list(range(1, 21))  # every step once
    assert "no usable worker" in stderr and "next round in" in stderr
