"""``--fingerprint-every N``: the coordinator's and the worker's replica fingerprints hold their moments at every
N-th version and their samples alone between, each side takes each version's once (the worker ahead, in the
kind the next order asks for), the run is the run of ``--fingerprint-every 1`` bit for bit, and a drift the
samples miss is caught at the next version with moments."""

from __future__ import annotations

import pytest
import torch

from gradwire import protocol
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.round import RoundWork
from gradwire.coordinator.trainer import Trainer
from gradwire.replica import Replica
from gradwire.worker.inprocess import in_process_clients

STEPS = 8


def _config(tmp_path, name: str, every: int) -> TrainConfig:
    return TrainConfig(
        model="gpt-tiny",
        steps=STEPS,
        batch_size=2,
        sequence_length=32,
        eval_every=0,
        checkpoint_every=0,
        spot_check_every=0,
        balance="off",
        fingerprint_every=every,
        output_dir=str(tmp_path / name),
    )


class Seen:
    """Each work order's base version and whether its fingerprint holds moments, and each fingerprint a replica
    took of its parameters: (the replica, its version, with moments)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.orders: list[tuple[int, bool]] = []
        self.taken: list[tuple[int, int, bool]] = []
        order, fingerprint_of = RoundWork.order, Replica.fingerprint_of

        def recorded_order(work, *args, **kwargs):
            made = order(work, *args, **kwargs)
            self.orders.append((made.base_version, made.fingerprint.has_moments))
            return made

        def recorded_fingerprint(replica, tensors, with_moments: bool = True):
            if tensors is replica.params:
                self.taken.append((id(replica), replica.version, with_moments))
            return fingerprint_of(replica, tensors, with_moments)

        monkeypatch.setattr(RoundWork, "order", recorded_order)
        monkeypatch.setattr(Replica, "fingerprint_of", recorded_fingerprint)


def _run(config: TrainConfig, drift_at: int | None = None):
    """Train round by round; before round ``drift_at`` the worker's copy moves at a position no sample reads.
    Returns the trainer, the records, each round's update as bytes, and the worker's replica."""
    clients = in_process_clients(1)
    trainer = Trainer(config, clients, progress=False)
    records, updates = [], []
    try:
        trainer.connect()
        for step in range(config.steps):
            if step == drift_at:
                (session,) = clients[0].engine.sessions.values()
                r = session.replica
                name, p = min(r.params.items(), key=lambda kv: kv[1].numel())  # a norm's weight: ones
                sampled = set(r._positions[list(r.params).index(name)].tolist())
                with torch.no_grad():
                    p.view(-1)[next(i for i in range(p.numel()) if i not in sampled)] += 0.5
            record = trainer.train_step()
            assert record is not None
            trainer.durable.log()
            records.append(record)
            updates.append(protocol.update_to_bytes(trainer.pending))
        trainer.outer.settle()
        (session,) = clients[0].engine.sessions.values()
        return trainer, records, updates, session.replica
    finally:
        trainer.close()


def test_moments_every_nth_version_on_both_sides_and_the_same_run(tmp_path, monkeypatch) -> None:
    _, _, straight_updates, straight_worker = _run(_config(tmp_path, "every-1", 1))
    seen = Seen(monkeypatch)
    trainer, records, updates, worker = _run(_config(tmp_path, "every-3", 3))

    # Each order's fingerprint holds its moments where its base version is a multiple of 3.
    assert len(seen.orders) == STEPS
    assert all(moments == (version % 3 == 0) for version, moments in seen.orders), seen.orders
    assert {v for v, m in seen.orders if m} >= {3, 6} and any(not m for _, m in seen.orders)

    # Each side takes each version's fingerprint once, in that kind: the worker's, taken ahead after its result,
    # is the one its next check reads (no second pass at the check).
    for who in (id(trainer.outer.replica), id(worker)):
        taken = [(v, m) for r, v, m in seen.taken if r == who]
        assert taken and all(m == (v % 3 == 0) for v, m in taken), taken
        assert len({v for v, _ in taken}) == len(taken), taken  # no version's taken twice
    assert [r["pushes"] for r in records] == [1] + [0] * (STEPS - 1)

    # The cadence moves no bit of the run: the same updates, the same replicas.
    assert updates == straight_updates
    for (name, p), q in zip(worker.params.items(), straight_worker.params.values()):
        assert torch.equal(p, q), name
    for (name, p), q in zip(trainer.replica.params.items(), worker.params.values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("every", [1, 3])
def test_a_drift_no_sample_reads_is_caught_at_the_next_version_with_moments(tmp_path, monkeypatch, every) -> None:
    seen = Seen(monkeypatch)
    _, records, _, _ = _run(_config(tmp_path, f"drift-{every}", every), drift_at=5)
    pushed = [i for i, r in enumerate(records) if r["pushes"]]
    # The first round whose order checks moments after the drift finds it, and the worker gets the state.
    checked = next(i for i, (_, moments) in enumerate(seen.orders) if i >= 5 and moments)
    assert pushed == [0, checked]
    if every == 3:
        assert checked == 7  # rounds 5 and 6 check versions 4 and 5: samples alone, which saw nothing
