"""A worker that misses rounds catches up by replaying the updates it missed, not by a state push, while
they are in the replay window; past it, or when the updates cost more than the state, it gets the state."""

from __future__ import annotations

from pathlib import Path

import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.worker.engine import WorkerEngine

from ..faults import faulty
from .conftest import live_workers, train

MISSED = {3, 4, 5}  # rounds worker 1's calls are dropped


def run(tmp_path: Path, **changes: object) -> tuple[list[dict], object, list]:
    config = TrainConfig(
        model="gpt-tiny", steps=9, batch_size=2, sequence_length=32, output_dir=str(tmp_path), **changes
    )
    with live_workers(2, [lambda: WorkerEngine("cpu"), faulty("drop", rounds=MISSED)]) as workers:
        trainer = train(config, workers)
        trainer.flush()
        sessions = [next(iter(w.engine.sessions.values())) for w in workers]
        for session in sessions:
            if session.replica.version < trainer.replica.version:
                session.replica.apply(trainer.outer.pending)
            for name, p in trainer.replica.params.items():
                assert torch.equal(session.replica.params[name], p), name  # both in step at the end
    return read_metrics(tmp_path), trainer, workers


def test_a_worker_that_missed_three_rounds_replays_them(tmp_path: Path) -> None:
    records, trainer, _ = run(tmp_path)
    by_step = {r["step"]: r for r in records}
    for step in (4, 5, 6):  # rounds 3-5: one worker's share
        assert by_step[step]["successful_workers"] == 1
    back = by_step[7]  # round 6: the worker says it is behind, replays 3 missed updates + the pending one
    assert (back["successful_workers"], back["catch_ups"], back["pushes"]) == (2, 1, 0)
    assert back["bytes_down"] < trainer.state_bytes / 10, (back["bytes_down"], trainer.state_bytes)
    assert sum(r["pushes"] for r in records) == 2  # the first round's two pushes, and no other


def test_past_the_replay_window_the_state_is_pushed(tmp_path: Path) -> None:
    records, trainer, _ = run(tmp_path, replay_window=2)
    back = {r["step"]: r for r in records}[7]
    assert (back["successful_workers"], back["catch_ups"], back["pushes"]) == (2, 0, 1)
    assert back["bytes_down"] > trainer.state_bytes
