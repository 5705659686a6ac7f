"""The update log in a run (``coordinator.durable``): each round appended before its update goes out, compacted
at checkpoints, and a coordinator restarted after its last logged round resumes where it stood, by replay, its
workers' sessions and error feedback untouched: the run is the uninterrupted run, bit for bit. Where a worker
lost its replica the run goes on from the checkpoint instead, as before."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gradwire.compression import schedule
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.durable import RoundState, decide_replay, log_path, read_records
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.coordinator.updatelog import read_log
from gradwire.v1 import log_pb2
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessClient

from ..faults import FaultPlan, FaultyEngine, supervise
from .conftest import live_workers

STEPS = 7


SETTINGS = {"model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "sequence_length": 16, "balance": "off"}


def _config(out: Path, **changes: object) -> TrainConfig:
    """A checkpoint every 3 rounds: a run killed after 5 has rounds 3 and 4 in its log alone."""
    return TrainConfig(**SETTINGS, checkpoint_every=3, output_dir=str(out), **changes)


def _engines_factory() -> Callable[[], FaultyEngine]:
    return lambda: FaultyEngine(FaultPlan("drop", rounds=()))  # counts the state pushes it gets, drops nothing


def _engines(n: int = 2) -> list[FaultyEngine]:
    return [_engines_factory()() for _ in range(n)]


def _clients(engines: list[WorkerEngine]) -> list[InProcessClient]:
    return [InProcessClient(e, f"in-process-{i}") for i, e in enumerate(engines)]


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    trainer.flush()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


_STRAIGHT: dict[tuple, dict[str, torch.Tensor]] = {}  # the uninterrupted runs' parameters, by settings


def _straight(out: Path, **changes: object) -> dict[str, torch.Tensor]:
    """The final parameters of the uninterrupted run of these settings (run once per settings and process)."""
    key = tuple(sorted(changes.items()))
    if key not in _STRAIGHT:
        trainer = Trainer(_config(out, **changes), _clients(_engines()), progress=False)
        try:
            trainer.run()
            _STRAIGHT[key] = _params(trainer)
        finally:
            trainer.close()
    return _STRAIGHT[key]


def _killed_after(trainer: Trainer, rounds: int) -> None:
    """What ``run`` does for ``rounds`` rounds, then nothing: the process dies between two rounds (after the
    last round's record, before its next orders), with no checkpoint at the end."""
    trainer.connect()
    for _ in range(rounds):
        assert trainer.train_step() is not None
        trainer.durable.log()
        trainer.maybe_save_checkpoint()
    trainer.outer.settle()


def _in_flight(trainer: Trainer) -> None:
    """The next round's results come in, and the process dies before its record is written."""
    assert trainer.train_step() is not None
    trainer.outer.settle()


def _resumed(out: Path, engines: list[FaultyEngine], **changes: object) -> tuple[list[dict], dict, Trainer]:
    """A coordinator started again on ``out`` (``--resume-from`` its checkpoints unless ``changes`` say
    otherwise) with ``engines``' workers, run to the end: its records, its final parameters, itself."""
    config = _config(out, **{"resume_from": str(out / "checkpoints"), **changes})
    trainer = Trainer(config, _clients(engines), progress=False)
    try:
        rows = trainer.run()
        return rows, _params(trainer), trainer
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("inner_steps", "in_flight", "torn"),
    [(1, False, False), (3, False, False), (1, True, False), (3, True, False), (3, False, True)],
)
def test_a_restart_replays_the_log_and_is_the_uninterrupted_run(
    tmp_path: Path, inner_steps: int, in_flight: bool, torn: bool
) -> None:
    """Killed between rounds, or (``in_flight``) once round 5's results were in but before its record: its
    workers then hold the version after round 4's update, and send round 5's results again when asked.
    ``torn``: killed inside round 4's append, so the log ends at round 3; round 5's orders never went out (the
    append comes first), and round 4's results go again."""
    straight = _straight(tmp_path / "straight", inner_steps=inner_steps)
    out = tmp_path / "killed"
    engines = _engines()
    first = Trainer(_config(out, inner_steps=inner_steps), _clients(engines), progress=False)
    _killed_after(first, 5)  # a checkpoint at step 3, rounds 3 and 4 only in the log
    if in_flight:
        _in_flight(first)
    if torn:  # the last record cut short: a crash inside its append
        path = log_path(out / "checkpoints")
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size - 100)
    records = read_records(log_path(out / "checkpoints"), 1 << 30)
    assert [r.round for r in records] == [3, 4][: 2 - torn]
    assert all(r.to_version == r.from_version + 1 for r in records)
    state = RoundState.from_bytes(records[-1].coordinator_state)
    assert state.step == 5 - torn and state.run_id == first.run_id and len(state.senders) == 2
    pushes = [e.pushes for e in engines]

    rows, resumed, _ = _resumed(out, engines, inner_steps=inner_steps)  # the same workers, replicas kept
    first.close()
    assert [r["step"] for r in rows] == list(range(6 - torn, 8))  # nothing trained twice, nothing lost
    assert [e.pushes for e in engines] == pushes  # no state pushed: each worker went on from its own replica
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    # In flight: each worker's round 5 went again as it was computed, not computed twice.
    assert [e.rounds.resent for e in engines] == [int(in_flight) + int(torn)] * 2
    assert read_records(log_path(out / "checkpoints"), 1 << 30) == []  # the final checkpoint holds them all


@pytest.mark.parametrize(
    "changes",
    [
        {"overlap": True},
        {"inner_steps": 3, "overlap": True},
        {"inner_steps": 4, "fragments": 2},
        {"downlink": "compressed"},
        {"outer_optimizer": "adamw"},
    ],
)
def test_every_kind_of_round_resumes_from_the_log(tmp_path: Path, changes: dict) -> None:
    """--overlap (each round computes before the update in flight), streamed fragments (each round's update
    moves one fragment), a compressed downlink (its error feedback on the coordinator) and AdamW on the
    coordinator (its moments) resume by replay too, between two rounds: nothing pushed, the same run. The
    last two log the senders' payloads beside the update, and a resume re-runs their outer steps."""
    straight = _straight(tmp_path / "straight", **changes)
    out = tmp_path / "killed"
    engines = _engines()
    first = Trainer(_config(out, **changes), _clients(engines), progress=False)
    _killed_after(first, 5)
    # Each record's senders' payloads went to the log as they arrived: the record names them by position.
    frames = [log_pb2.LogRecord.FromString(body) for body, _ in read_log(log_path(out / "checkpoints")).frames()]
    assert [len(f.received) for f in frames] == [2, 2]
    made = "outer_optimizer" in changes or "downlink" in changes  # the update is made from the payloads
    assert all(sorted(f.contributions_received if made else f.update_received) == [0, 1] for f in frames)
    rows, resumed, _ = _resumed(out, engines, **changes)
    first.close()
    assert [r["step"] for r in rows] == [6, 7] and [e.pushes for e in engines] == [1, 1]
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_a_top_k_warm_up_resumes_from_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient mode's top-k warm-up (--topk-warmup-steps) spanning the kill: the logged rounds' payloads are
    of the warm top-k and the rounds after of the rest's; the replay decodes each with its own codec, and the
    run is the uninterrupted run."""
    monkeypatch.setattr(schedule, "MAX_WARMUP_SHARE", 1.0)  # 4 warm steps of 7 (a real run's: a tenth at most)
    changes = {"topk_warmup_steps": 4}
    assert _config(tmp_path, **changes).topk_warmup().steps == 4
    straight = _straight(tmp_path / "straight", **changes)
    out = tmp_path / "killed"
    engines = _engines()
    first = Trainer(_config(out, **changes), _clients(engines), progress=False)
    _killed_after(first, 5)
    logged = read_records(log_path(out / "checkpoints"), 1 << 30)
    warm, rest = first.planner.topk.warm, first.planner.topk.rest
    assert [r.update.payloads[0].settings.topk for r in logged] == [warm, rest] and warm > rest
    rows, resumed, _ = _resumed(out, engines, **changes)
    first.close()
    assert [r["step"] for r in rows] == [6, 7] and [e.pushes for e in engines] == [1, 1]
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


@pytest.mark.parametrize("inner_steps", [1, 3])
def test_an_overlapped_round_in_flight_is_sent_again_not_pushed(tmp_path: Path, inner_steps: int) -> None:
    """--overlap, killed once round 5's results were in but before its record: its workers computed round 5
    before round 4's update and applied that update since, one version past the log's last round. Asked for
    round 5 at the version they hold, they send its results again: nothing pushed, the same run."""
    changes = {"inner_steps": inner_steps, "overlap": True}
    straight = _straight(tmp_path / "straight", **changes)
    out = tmp_path / "killed"
    engines = _engines()
    first = Trainer(_config(out, **changes), _clients(engines), progress=False)
    _killed_after(first, 5)
    _in_flight(first)
    rows, resumed, second = _resumed(out, engines, **changes)
    first.close()
    assert [r["step"] for r in rows] == [6, 7] and second.run_id == first.run_id
    assert [e.pushes for e in engines] == [1, 1]
    assert [e.rounds.resent for e in engines] == [1, 1]
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_restart_just_after_a_checkpoint_keeps_the_workers_replicas(tmp_path: Path, in_flight: bool) -> None:
    """Killed once the checkpoint at step 6 compacted the log: nothing to replay, yet the workers kept their
    replicas, before the checkpoint's last update (they catch up by it) or, with round 6 in flight, after it
    (they send round 6 again). No state is pushed, and the run is the uninterrupted one."""
    straight = _straight(tmp_path / "straight")
    out = tmp_path / "killed"
    engines = _engines()
    first = Trainer(_config(out), _clients(engines), progress=False)
    _killed_after(first, 6)
    assert read_records(log_path(out / "checkpoints"), 1 << 30) == []
    if in_flight:
        _in_flight(first)
    rows, resumed, second = _resumed(out, engines)
    first.close()
    assert [r["step"] for r in rows] == [7]
    assert [e.pushes for e in engines] == [1, 1] and second.run_id == first.run_id
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    assert [e.rounds.resent for e in engines] == [int(in_flight)] * 2


def test_workers_that_lost_their_replicas_resume_from_the_checkpoint(tmp_path: Path) -> None:
    straight = _straight(tmp_path / "straight")
    out = tmp_path / "killed"
    first = Trainer(_config(out), _clients(_engines()), progress=False)
    _killed_after(first, 5)
    first.close()
    fresh = _engines()  # the workers restarted too: they hold nothing of the run
    rows, resumed, _ = _resumed(out, fresh)
    assert [r["step"] for r in rows] == [4, 5, 6, 7]  # from the checkpoint at step 3, as the straight run
    assert all(e.pushes == 1 for e in fresh)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    assert [r["step"] for r in read_metrics(out)] == [4, 5, 6, 7]


def test_the_replay_decision_names_the_workers_that_lost_their_replicas() -> None:
    logged = {"w-a": 5, "w-b": 5}
    assert decide_replay(logged, {"w-a": 5, "w-b": 5})[0]
    assert decide_replay(logged, {"w-a": 5})[0]  # w-b left the run: the others carry on
    ok, why = decide_replay(logged, {"w-a": 5, "w-b": None})
    assert not ok and "w-b holds no replica" in why
    assert decide_replay(logged, {"w-a": 6, "w-b": 5})[0]  # w-a had the next order: it sends that round again
    ok, why = decide_replay(logged, {"w-a": 7, "w-b": 5})
    assert not ok and "w-a holds 7, not 5" in why
    assert not decide_replay(logged, {"w-c": 0})[0]


COORDINATOR = [sys.executable, "-m", "gradwire.coordinator", "train"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


SUPERVISED = ["--model", "gpt-tiny", "--steps", "80", "--batch-size", "3", "--sequence-length", "16", "--no-progress"]
SUPERVISED += ["--checkpoint-every", "16", "--balance", "off", "--resume-from", "auto"]
KILLS = 6


@pytest.mark.slow
def test_a_supervised_coordinator_killed_again_and_again_trains_every_round_once_and_pushes_nothing(
    tmp_path: Path,
) -> None:
    """A supervisor loop re-runs the same command (``--resume-from auto``) after each of 6 SIGKILLs over 80
    rounds with 3 workers, dealt at random points (inside rounds, log appends, checkpoints every 16 rounds):
    every step is trained once with the uninterrupted run's loss, no worker gets the state after its first
    push, and the trained model is the same, bit for bit."""
    rng = random.Random(46)
    with live_workers(3, _engines_factory()) as workers:
        straight = tmp_path / "straight"
        argv = [*COORDINATOR, *SUPERVISED, "--workers", ",".join(w.address for w in workers)]
        argv += ["--output-dir", str(straight)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV)
        assert done.returncode == 0, done.stderr[-3000:]
    with live_workers(3, _engines_factory()) as workers:
        out = tmp_path / "run"
        argv = [*COORDINATOR, *SUPERVISED, "--workers", ",".join(w.address for w in workers), "--output-dir", str(out)]
        logs = supervise(argv, out, KILLS, rng, rounds_apart=13, env=ENV)
        assert len(logs) == KILLS
        assert [w.engine.pushes for w in workers] == [1, 1, 1], "\n".join(x[-2000:] for x in logs)
    assert _losses(out) == _losses(straight)
    final, reference = (load_file(run / "final" / "model.safetensors") for run in (out, straight))
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)


def test_overwrite_replaces_a_run_and_its_log_before_logging_anew(tmp_path):
    """--overwrite removes the run in the directory before the new run's update log opens there: the new run
    logs its rounds and compacts its log at its final checkpoint (a log opened first was removed under it)."""
    first = _straight(tmp_path / "run")  # a finished run holds the directory
    trainer = Trainer(_config(tmp_path / "run", overwrite=True, seed=1), _clients(_engines()), progress=False)
    try:
        trainer.run()
        again = _params(trainer)
    finally:
        trainer.close()
    assert log_path(tmp_path / "run" / "checkpoints").is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, STEPS + 1))
    assert any(not torch.equal(first[n], again[n]) for n in first)  # another run (another seed), not the first
