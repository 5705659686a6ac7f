"""Gossip rounds in the update log (``coordinator.gossip_log``): a coordinator restarted after its last logged
round takes the checkpoint's public copies on by the logged rounds, its workers keep their sessions (no state
pushed), a round in flight is answered again, not computed twice, and the run is the uninterrupted run, bit
for bit: losses, consensus distances, public copies. Relayed and peer-to-peer."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.durable import log_path, read_records
from gradwire.coordinator.gossip_trainer import GossipTrainer
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.protocol import ProtocolError
from gradwire.security import ClientSecurity

from ..faults import FaultPlan, FaultyEngine, supervise
from .conftest import live_workers

pytestmark = pytest.mark.slow  # each test trains three short gossip runs

STEPS = 7
_LINKED = {False: "relayed_payloads", True: "pulled_payloads"}  # each worker's neighbours' messages, by address
MODES = pytest.mark.parametrize("peer_to_peer", [False, True], ids=["relayed", "peer-to-peer"])


def _config(out: Path, peer_to_peer: bool, **changes: object) -> TrainConfig:
    """A compressed ring of 4 with a checkpoint every 3 rounds: a run killed after 5 has rounds 3 and 4 in its
    log alone (and round 2, the checkpoint's anchor)."""
    settings = dict(
        model="gpt-tiny",
        steps=STEPS,
        batch_size=2,
        sequence_length=32,
        inner_steps=3,
        eval_batches=2,
        round_timeout=60.0,
        topology="ring",
        inner_optimizer="demuon",
        inner_learning_rate=0.02,
        checkpoint_every=3,
        peer_to_peer=peer_to_peer,
        output_dir=str(out),
    )
    return TrainConfig(**{**settings, **changes})


def _engine() -> FaultyEngine:
    return FaultyEngine(FaultPlan("drop", rounds=()))  # counts the state pushes it gets, drops nothing


def _trainer(config: TrainConfig, workers, security: ClientSecurity | None = None) -> GossipTrainer:
    """A coordinator of ``workers``; ``security``: a restarted one's, with the run key it kept (``run.key``)."""
    security = security or ClientSecurity()
    clients = [WorkerClient(w.address, timeout=60.0, security=security) for w in workers]
    trainer = Trainer(config, clients, progress=False)
    assert isinstance(trainer, GossipTrainer)
    return trainer


def _copies(trainer: GossipTrainer) -> dict[str, dict[str, torch.Tensor]]:
    trainer.shown_model()  # peer-to-peer: the exact copies, pulled from their owners
    g = trainer.gossip
    return {m: {k: v.clone() for k, v in g.copies.copy_of(m).items()} for m in g.copies.members}


def _straight(out: Path, peer_to_peer: bool) -> tuple[list[dict], dict]:
    with live_workers(4, _engine) as workers:
        trainer = _trainer(_config(out, peer_to_peer), workers)
        try:
            trainer.run()
            return read_metrics(out), _copies(trainer)
        finally:
            trainer.close()


def _killed_after(trainer: GossipTrainer, rounds: int, in_flight: bool) -> None:
    """What ``run`` does for ``rounds`` rounds, then (``in_flight``) one more round whose results come in but
    whose record is never written: the process dies there."""
    trainer.connect()
    for _ in range(rounds):
        assert trainer.train_step() is not None
        trainer.durable.log()
        trainer.maybe_save_checkpoint()
    if in_flight:
        assert trainer.train_step() is not None


@MODES
@pytest.mark.parametrize("in_flight", [False, True], ids=["between-rounds", "in-flight"])
def test_a_restarted_gossip_run_replays_its_log_and_is_the_uninterrupted_run(
    tmp_path: Path, peer_to_peer: bool, in_flight: bool
) -> None:
    straight_rows, straight_copies = _straight(tmp_path / "straight", peer_to_peer)
    out = tmp_path / "killed"
    with live_workers(4, _engine) as workers:
        key = ClientSecurity()
        first = _trainer(_config(out, peer_to_peer), workers, key)
        _killed_after(first, 5, in_flight)
        records = read_records(log_path(out / "checkpoints"), 1 << 30)
        assert [r.round for r in records] == [2, 3, 4]  # the checkpoint at step 3 keeps round 2's bookkeeping
        assert all(r.update is None and r.gossip is not None and r.to_version == r.from_version for r in records)
        if not peer_to_peer:  # every worker's message, relayed: they rebuild the copies
            assert all(len(r.gossip.accepted) == 4 for r in records)
        pushes = [w.engine.pushes for w in workers]
        resumed = _trainer(_config(out, peer_to_peer, resume_from=str(out / "checkpoints")), workers, key)
        try:
            rows = resumed.run()
            copies = _copies(resumed)
        finally:
            resumed.close()
            first.close()
        assert [w.engine.pushes for w in workers] == pushes == [1] * 4  # each went on from its own session
        assert [w.engine.rounds.resent for w in workers] == [int(in_flight)] * 4
    assert resumed.run_id == first.run_id
    assert [r["step"] for r in rows] == list(range(6, STEPS + 1))  # nothing trained twice, nothing lost
    for ours, theirs in zip(rows, straight_rows[5:], strict=True):
        assert ours["step"] == theirs["step"] and ours["loss"] == theirs["loss"], ours["step"]
        assert ours["consensus_distance"] == theirs["consensus_distance"], ours["step"]
        linked = [sorted(r[_LINKED[peer_to_peer]].values()) for r in (ours, theirs)]
        assert linked[0] == linked[1] == [2] * 4  # the neighbours' messages, no copy sent whole
    assert copies.keys() == straight_copies.keys()
    for m, tensors in straight_copies.items():
        assert all(torch.equal(copies[m][k], v) for k, v in tensors.items()), m


@MODES
def test_a_restart_just_after_a_checkpoint_pushes_nothing(tmp_path: Path, peer_to_peer: bool) -> None:
    """Killed once the checkpoint at step 6 compacted the log: the round before it is all the log holds, and
    its bookkeeping is enough to go on with the workers' sessions."""
    straight_rows, _ = _straight(tmp_path / "straight", peer_to_peer)
    out = tmp_path / "killed"
    with live_workers(4, _engine) as workers:
        key = ClientSecurity()
        first = _trainer(_config(out, peer_to_peer), workers, key)
        _killed_after(first, 6, in_flight=False)
        assert [r.round for r in read_records(log_path(out / "checkpoints"), 1 << 30)] == [5]
        resumed = _trainer(_config(out, peer_to_peer, resume_from=str(out / "checkpoints")), workers, key)
        try:
            rows = resumed.run()
        finally:
            resumed.close()
            first.close()
        assert [w.engine.pushes for w in workers] == [1] * 4
    assert [r["step"] for r in rows] == [7]
    assert rows[0]["loss"] == straight_rows[-1]["loss"]
    assert sorted(rows[0][_LINKED[peer_to_peer]].values()) == [2] * 4  # no copy sent whole


def test_workers_that_lost_their_sessions_resume_a_gossip_run_from_the_checkpoint(tmp_path: Path) -> None:
    straight_rows, _ = _straight(tmp_path / "straight", False)
    out = tmp_path / "killed"
    with live_workers(4, _engine) as workers:
        first = _trainer(_config(out, False), workers)
        _killed_after(first, 5, in_flight=False)
        first.close()
    with live_workers(4, _engine) as fresh:  # restarted too: they hold nothing of the run
        resumed = _trainer(_config(out, False, resume_from=str(out / "checkpoints")), fresh)
        try:
            rows = resumed.run()
        finally:
            resumed.close()
        assert [w.engine.pushes for w in fresh] == [1] * 4
    assert [r["step"] for r in rows] == [4, 5, 6, 7]  # from the checkpoint at step 3, as the straight run
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight_rows][3:]


COORDINATOR = [sys.executable, "-m", "gradwire.coordinator", "train"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SUPERVISED = ["--model", "gpt-tiny", "--steps", "24", "--batch-size", "2", "--sequence-length", "32", "--no-progress"]
SUPERVISED += ["--topology", "ring", "--inner-steps", "2", "--checkpoint-every", "8", "--balance", "off"]
SUPERVISED += ["--resume-from", "auto"]
KILLS = 3


def _losses(out: Path) -> list[tuple[int, float, float]]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"], r["consensus_distance"]) for r in rows]


@MODES
def test_a_supervised_gossip_coordinator_killed_again_and_again_trains_every_round_once_and_pushes_nothing(
    tmp_path: Path, peer_to_peer: bool
) -> None:
    """A supervisor loop re-runs the same command (``--resume-from auto``) after each of 3 SIGKILLs over 24
    gossip rounds of a ring of 3, dealt at random points (inside rounds, appends, checkpoints every 8): every
    step is trained once with the uninterrupted run's loss and consensus distance, no worker gets the state
    after its first push, and the consensus exported is the same, bit for bit."""
    rng = random.Random(48 + peer_to_peer)
    argv = [*COORDINATOR, *SUPERVISED, *(["--peer-to-peer"] if peer_to_peer else [])]
    with live_workers(3, _engine) as workers:
        straight = tmp_path / "straight"
        workers_arg = ["--workers", ",".join(w.address for w in workers)]
        done = subprocess.run(
            [*argv, *workers_arg, "--output-dir", str(straight)], capture_output=True, text=True, timeout=300, env=ENV
        )
        assert done.returncode == 0, done.stderr[-3000:]
    with live_workers(3, _engine) as workers:
        out = tmp_path / "run"
        command = [*argv, "--workers", ",".join(w.address for w in workers), "--output-dir", str(out)]
        logs = supervise(command, out, KILLS, rng, rounds_apart=6, env=ENV)
        assert len(logs) == KILLS
        assert [w.engine.pushes for w in workers] == [1, 1, 1], "\n".join(x[-2000:] for x in logs)
    assert _losses(out) == _losses(straight)
    final, reference = (load_file(run / "final" / "model.safetensors") for run in (out, straight))
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)


def test_a_gossip_round_asked_for_again_is_sent_again_and_its_links_are_never_taken_twice(tmp_path: Path) -> None:
    """The worker's side of a resume: the round it computed last, asked for again with the same links, is
    answered with the result it sent (its copies and model have moved on by it); without that result (the
    round broke off after its links were taken) the same links are refused, not added twice."""
    with live_workers(3, _engine) as workers:
        trainer = _trainer(_config(tmp_path / "run", False, steps=2, checkpoint_every=0), workers)
        try:
            trainer.run()
        finally:
            trainer.close()
        engine = workers[0].engine
        (session,) = engine.sessions.values()
        done, order = session.last_done, engine.last_order
        assert done is not None and order is not None and order.gossip is not None and done.order.round == 1
        copies = {m: {k: v.clone() for k, v in c.items()} for m, c in session.gossip.node.copies.items()}
        assert engine.run_round(order, owner=session.owner) is done.result
        assert engine.rounds.resent == 1
        other = dataclasses.replace(order, gossip=dataclasses.replace(order.gossip, gamma=0.25))
        assert not done.serves(other, session.replica.version)[0]  # other links: another round
        session.last_done = None
        with pytest.raises(ProtocolError, match="taken here already"):
            engine.run_round(order, owner=session.owner)
        for m, c in session.gossip.node.copies.items():  # nothing was added twice
            assert all(torch.equal(v, copies[m][k]) for k, v in c.items())
