"""Two honest workers and one bad one (tests/faults.py) against real servers: the run ends within 2% of the
honest pair's held-out loss, every worker still in the run holds the coordinator's replica bit for bit,
and the bad worker is clipped, rejected or benched as the log and metrics say. Spot checks run every round
(``--spot-check-every 1``: each of the three is recomputed every third round), so that a gradient of other
rows is caught within the rounds the test allows."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import in_process_clients

from ..faults import FaultyEngine, faulty
from .conftest import LiveWorker, live_workers, run_trainer, train

STEPS = 24


def config(tmp_path: Path, name: str, **changes: object) -> TrainConfig:
    settings = dict(
        model="gpt-tiny",
        steps=STEPS,
        batch_size=4,
        sequence_length=32,
        eval_batches=4,
        output_dir=str(tmp_path / name),
        seed=3,
        spot_check_every=1,
    )
    settings.update(changes)
    return TrainConfig(**settings)


def train_undefended(config: TrainConfig, workers: list[LiveWorker]) -> Trainer:
    """``train`` with no agreement check (``coordinator.agreement``): the attacker stays in every round."""
    trainer = Trainer(config, [w.client() for w in workers], progress=False)
    trainer.gather.agreement_floor = None  # (no flag for it: an attacker test's control, not a setting)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def held_out_loss(trainer) -> float:
    trainer.flush()
    return trainer.evaluate()


def assert_replica_is_the_coordinators(trainer, worker: LiveWorker) -> None:
    (session,) = worker.engine.sessions.values()
    trainer.flush()
    if session.replica.version == trainer.replica.version - 1:
        session.replica.apply(trainer.outer.pending)  # the last round's update, which it would replay next
    assert session.replica.version == trainer.replica.version
    for name, p in trainer.replica.params.items():
        assert torch.equal(session.replica.params[name], p), name


@pytest.fixture(scope="module")
def honest_loss(tmp_path_factory: pytest.TempPathFactory) -> float:
    with live_workers(2) as workers:
        return held_out_loss(train(config(tmp_path_factory.mktemp("honest"), "run"), workers))


BEHAVIOURS = {
    # name: (fault, what the coordinator must have done about it; None: nothing, it cannot tell)
    "x1000": (faulty("scale", factor=1000.0), "rejected"),  # far beyond the clip bound: left out, benched
    "minus-x1000": (faulty("scale", factor=-1000.0), "rejected"),
    "x4": (faulty("scale", factor=4.0), "clipped"),  # an outlier within reach: clipped to 2x the median, kept
    "nan": (faulty("nan"), "rejected"),
    "wrong-shape": (faulty("wrong-shape"), "rejected"),
    "lie-about-tokens": (faulty("lie-tokens", factor=100.0), "rejected"),
    "copy-a-peer": (faulty("copy"), "rejected"),  # another's payload of the last round: a copy, left out
    "sign-flip": (faulty("sign-flip"), "rejected"),  # at the honest norm: points away from the others, left out
    "zeros": (faulty("zeros"), "rejected"),  # nothing for the tokens it claims: an empty payload, left out
    # A gradient of other rows of the same text agrees like an honest one (coordinator.agreement); the spot
    # check recomputes it from the rows it was sent: caught, left out and benched at once.
    "other-rows": (faulty("other-rows"), "rejected"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_one_bad_worker_among_three_does_not_hurt(
    tmp_path: Path, honest_loss: float, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    fault, expected = BEHAVIOURS[name]
    # Slots 0 and 1 are the honest pair of the baseline run: same data, same seed.
    with (
        caplog.at_level(logging.WARNING, logger="gradwire.coordinator"),
        live_workers(3, [lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu"), fault]) as workers,
    ):
        trainer = train(config(tmp_path, name), workers)
        loss = held_out_loss(trainer)
        bad = workers[2].engine
        assert isinstance(bad, FaultyEngine) and bad.injected, "the fault never fired"
        for worker in workers[:2]:
            assert_replica_is_the_coordinators(trainer, worker)
    records = read_metrics(tmp_path / name)
    assert len(records) == STEPS
    if expected is None:
        assert sum(r["rejected"] + r["clipped"] + r["benched"] for r in records) == 0
    else:
        assert sum(r[expected] for r in records) >= 1, f"no round {expected} the bad worker"
    assert max(r["benched"] for r in records) == (1 if expected == "rejected" else 0)  # benched after its strikes
    if expected == "rejected":
        assert min(i for i, r in enumerate(records) if r["benched"]) < 10, "benched only after 10 rounds"
    assert loss <= 1.02 * honest_loss, f"{name}: held-out loss {loss:.4f} vs {honest_loss:.4f} for the honest pair"
    copies = [r.message for r in caplog.records if "left out: a copy" in r.message]
    assert bool(copies) == name.startswith("copy"), copies[:3]  # only the copier is taken for one


@pytest.mark.slow
def test_without_defences_a_sign_flipping_worker_does_hurt(tmp_path: Path, honest_loss: float) -> None:
    """The control: the same attacker, clipping, benching and the agreement check off, really does damage
    (so the test above measures the defence, not a harmless fault)."""
    with live_workers(
        3, [lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu"), faulty("scale", factor=-1000.0)]
    ) as workers:
        loss = held_out_loss(train_undefended(config(tmp_path, "open", clip_factor=0.0, bench_after=0), workers))
    assert loss > 1.02 * honest_loss


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["median", "trimmed-mean"])
def test_coordinate_rules_train_and_keep_replicas_identical(tmp_path: Path, mode: str) -> None:
    with live_workers(
        3, [lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu"), faulty("scale", factor=-1000.0)]
    ) as workers:
        trainer = train_undefended(  # the attacker stays in: the coordinate rule alone must bear it
            config(
                tmp_path,
                mode,
                aggregate=mode,
                no_compression=True,
                outer_optimizer="sgd",
                learning_rate=0.05,
                bench_after=0,
                steps=8,
            ),
            workers,
        )
        for worker in workers:  # the bad worker replays the same updates too
            assert_replica_is_the_coordinators(trainer, worker)
    records = read_metrics(tmp_path / mode)
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.slow
def test_three_honest_workers_are_never_taken_for_copies_nor_benched_in_200_rounds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # In process (the defences are the coordinator's; the transport has its own tests): 200 rounds cost less.
    # Equal shares (--balance off): balancing by measured speed makes the run depend on the machine's load (on
    # a loaded machine, 3-5 rows of 4 here), and one such run benched an honest worker. Few rows alone do not:
    # a worker held at 1 row of 12 by a 4x slowdown was never clipped in 200 rounds.
    with caplog.at_level(logging.WARNING, logger="gradwire.coordinator"):
        run_trainer(
            config(tmp_path, "honest-200", steps=200, eval_batches=1, eval_every=0, balance="off"),
            in_process_clients(3),
        )
    records = read_metrics(tmp_path / "honest-200")
    assert len(records) == 200 and max(r["benched"] for r in records) == 0
    assert not [r.message for r in caplog.records if "a copy" in r.message]
    # Every worker's agreement score mostly stays above the floor (the lowest seen here: +0.22; in one CI run a
    # worker drifted to -0.41 for a few rounds late on: left out in 2 of them, never 3 in a row, never benched).
    pointing_away = [r.message for r in caplog.records if "points away" in r.message]
    assert len(pointing_away) <= 6, pointing_away
    assert sum(r["rejected"] for r in records) <= 2 + len(pointing_away)
