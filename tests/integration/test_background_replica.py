"""The coordinator's replica advances off the round's critical path (``coordinator.advance``): a slow apply
holds no round's close, the next orders go out before it finishes, and everything that reads the replica
(evaluation, checkpoints, spot checks, a push to a worker out of sync) sees the version it asks for. The run
is the run of a coordinator whose apply is instant, bit for bit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradwire import protocol
from gradwire.coordinator.advance import ReplicaAdvancer, ReplicaError
from gradwire.coordinator.checkpoint import latest_checkpoint, load_checkpoint
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.replica import Replica
from gradwire.worker.inprocess import in_process_clients

SLOW = 0.4  # seconds each apply of the slowed coordinator's replica sleeps first


class SlowApply:
    """A test double of the coordinator's replica apply: each job sleeps ``SLOW`` seconds first, and the
    time it ended is kept, by job (job k applies the update of round k)."""

    def __init__(self, trainer: Trainer) -> None:
        self.ended: list[float] = []
        outer, make_job = trainer.outer, trainer.outer._apply_job

        def slow_job(update):
            job = make_job(update)

            def run() -> None:
                time.sleep(SLOW)
                job()
                self.ended.append(time.monotonic())

            return run

        outer._apply_job = slow_job


def _config(tmp_path, name: str, **overrides) -> TrainConfig:
    settings = dict(
        model="gpt-tiny",
        steps=6,
        batch_size=2,
        sequence_length=32,
        eval_every=2,
        checkpoint_every=2,
        spot_check_every=1,
        spot_check_by="recompute",
        balance="off",
        output_dir=str(tmp_path / name),
    )
    return TrainConfig(**{**settings, **overrides})


def _run(config: TrainConfig, slow: bool, fault_at: int | None = None):
    """Train ``config`` round by round; returns the trainer, its records, each round's pending update as
    bytes, each round's outcome and, if ``slow``, the slowed apply's record."""
    clients = in_process_clients(1)
    trainer = Trainer(config, clients, progress=False)
    slowed = SlowApply(trainer) if slow else None
    outcomes = []
    run_round = trainer.rounds.run

    def recorded(*args, **kwargs):
        outcome = run_round(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    trainer.rounds.run = recorded
    updates, records = [], []
    try:
        trainer.connect()
        for step in range(config.steps):
            if step == fault_at:  # the worker's copy drifts: it gets a push of the round's version
                (session,) = clients[0].engine.sessions.values()
                with torch.no_grad():
                    next(iter(session.replica.params.values())).add_(0.05)
            record = trainer.train_step()
            assert record is not None
            if config.eval_every and trainer.step % config.eval_every == 0:
                record["eval_loss"] = trainer.evaluate()
            trainer.maybe_save_checkpoint()
            records.append(record)
            updates.append(protocol.update_to_bytes(trainer.pending))
        trainer.save_checkpoint()
    finally:
        trainer.close()
    return trainer, records, updates, outcomes, slowed, clients


def test_a_slow_replica_apply_holds_no_round_and_changes_no_bit(tmp_path):
    straight, s_records, s_updates, _, _, s_clients = _run(_config(tmp_path, "straight"), slow=False)
    slowed, records, updates, outcomes, slow, clients = _run(_config(tmp_path, "slowed"), slow=True)

    # Round k + 1 starts applying round k's update; its orders go out, and its results all come in, before
    # that apply ends: the round never waits for the coordinator's own copy. (After every second round an
    # evaluation and a checkpoint wait for it: they need that version, the round does not.)
    assert len(slow.ended) == len(outcomes)  # every round's update applied (the last one by the final flush)
    for k in range(0, len(outcomes) - 1, 2):
        after = outcomes[k + 1]
        assert after.first_order_at < slow.ended[k] and after.closed_at < slow.ended[k], k
    assert all(r["background_s"] >= 0 for r in records)
    assert all(r["turnaround_s"] is not None for r in records[1:])

    # The same run: payloads and updates byte for byte, losses, evaluations, spot checks, replicas.
    assert updates == s_updates
    for key in ("loss", "eval_loss", "grad_norm"):
        assert [r.get(key) for r in records] == [r.get(key) for r in s_records], key
    assert [r["spot_check"]["passed"] for r in records] == [True] * len(records)
    assert [r["pushes"] for r in records] == [1, 0, 0, 0, 0, 0]
    for (name, p), q in zip(slowed.replica.params.items(), straight.replica.params.values()):
        assert torch.equal(p, q), name
    (worker,) = clients[0].engine.sessions.values()
    worker.replica.apply(slowed.pending)  # the worker stands one update behind: the one in flight
    for name, p in slowed.replica.params.items():
        assert torch.equal(worker.replica.params[name], p), name

    # The checkpoints hold the same tensors.
    a, _ = load_checkpoint(latest_checkpoint(tmp_path / "slowed" / "checkpoints"))
    b, _ = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    assert a.keys() == b.keys()
    for group in a:
        if group == "rng":
            continue
        for name, t in a[group].items():
            assert torch.equal(t, b[group][name]), (group, name)


def test_a_push_to_a_worker_out_of_sync_sends_the_rounds_version_while_the_replica_advances(tmp_path):
    config = _config(tmp_path, "push", eval_every=0, checkpoint_every=0, spot_check_every=0)
    straight, s_records, s_updates, _, _, _ = _run(config, slow=False, fault_at=3)
    config = _config(tmp_path, "push-slowed", eval_every=0, checkpoint_every=0, spot_check_every=0)
    slowed, records, updates, _, _, clients = _run(config, slow=True, fault_at=3)
    # The drifted worker is told it is out of sync, gets the state at the round's version, and computes there.
    assert [r["pushes"] for r in records] == [1, 0, 0, 1, 0, 0] == [r["pushes"] for r in s_records]
    assert updates == s_updates
    (worker,) = clients[0].engine.sessions.values()
    worker.replica.apply(slowed.pending)
    for name, p in slowed.replica.params.items():
        assert torch.equal(worker.replica.params[name], p), name


def test_the_advancer_applies_in_order_and_a_failed_apply_fails_every_wait():
    replica = Replica(build_from_spec(model_spec("gpt-tiny"), seed=0), UpdateRule(optimizer="sgd"))
    advancer = ReplicaAdvancer(replica)
    order: list[int] = []
    gate = threading.Event()
    first = advancer.submit(lambda: (gate.wait(5), order.append(1)))
    second = advancer.submit(lambda: order.append(2))
    assert not advancer.idle  # the first job waits at the gate
    gate.set()
    advancer.settle()
    assert order == [1, 2] and advancer.idle and advancer.jobs == 2
    assert first.result() == second.result() == replica.fingerprint()  # nothing moved: the same fingerprint

    def refused() -> None:
        raise ValueError("update would move 'w' by inf")

    failed = advancer.submit(refused)
    with pytest.raises(ReplicaError, match="could not apply an update: update would move"):
        failed.result()
    with pytest.raises(ReplicaError):
        advancer.settle()
    advancer.close()
    assert advancer.submit(lambda: None).result() == replica.fingerprint()  # a new thread after close
    advancer.close()


def test_the_replicas_apply_starts_once_every_order_of_the_round_is_out(tmp_path):
    """Started before the orders, the apply took the cores they were made and sent on: each round's apply of
    the last update starts after both workers' orders were made (a push or a catch-up starts it at once:
    ``test_a_push_to_a_worker_out_of_sync_sends_the_rounds_version_while_the_replica_advances``)."""
    config = _config(tmp_path, "ordered", steps=4, eval_every=0, checkpoint_every=0, spot_check_every=0)
    clients = in_process_clients(2)
    trainer = Trainer(config, clients, progress=False)
    events: list[str] = []  # in the order they happened (each appended after what precedes it on its thread)
    make_job, make_order = trainer.outer._apply_job, trainer.rounds._order

    def noted_job(update):
        job = make_job(update)

        def run():
            events.append("apply")
            return job()

        return run

    def noted_order(*args, **kwargs):
        order = make_order(*args, **kwargs)
        events.append("order")
        return order

    trainer.outer._apply_job = noted_job
    trainer.rounds._order = noted_order
    try:
        trainer.connect()
        for _ in range(config.steps):
            assert trainer.train_step() is not None
    finally:
        trainer.close()
    # Round 0 has no update to apply; each later round makes its two orders, then starts the apply.
    assert events == ["order", "order"] + ["order", "order", "apply"] * (config.steps - 1), events
