"""Relayed star rounds (``coordinator train --relay peers``): the workers pull the update's payloads from
each other, and the run is the direct run bit for bit; a peer that serves wrong bytes, stalls or is gone
costs the puller a retry with the payloads in its order, and the coordinator names that peer for nothing a
while."""

from __future__ import annotations

import threading

import pytest
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.relay import QUIET_ROUNDS
from gradwire.coordinator.status import StatusBoard
from gradwire.coordinator.trainer import Trainer
from gradwire.errors import NotHeld
from gradwire.protocol import PieceRequest
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessPeers, in_process_clients

from ..faults import faulty
from .conftest import live_workers, run_trainer, train

SETTINGS = {"model": "gpt-tiny", "batch_size": 2, "sequence_length": 16, "downlink": "replay", "balance": "off"}


def _same(a, b) -> None:
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("relay", ["peers", "auto"])
def test_a_relayed_gradient_round_is_the_direct_one_and_the_coordinator_sends_no_payload(tmp_path, relay):
    """Four served workers over gRPC (Worker.PullPiece on loopback, which auto finds they all can dial),
    gradient mode with streamed buckets."""
    settings = dict(SETTINGS, steps=4, stream_buckets=2)
    with live_workers(4) as workers:
        direct = train(TrainConfig(**settings, output_dir=str(tmp_path / "direct")), workers)
    with live_workers(4) as workers:
        relayed = train(TrainConfig(**settings, relay=relay, output_dir=str(tmp_path / "relayed")), workers)
    _same(direct, relayed)
    a, b = read_metrics(tmp_path / "direct"), read_metrics(tmp_path / "relayed")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["bytes_up"] for r in a] == [r["bytes_up"] for r in b]
    for before, after in zip(a[1:], b[1:]):  # after the state push: each order carried 3 other payloads
        pulled = after["bytes_pulled"]
        assert pulled > 0 and after["relay_resent"] == 0
        # what the orders no longer carry is what the workers pulled (each payload's serialization)
        assert before["bytes_down"] - after["bytes_down"] == pytest.approx(pulled, rel=0.01)
        assert after["bytes_down"] < pulled / 20  # orders: batches, fingerprints, weights, references


def test_relayed_local_sgd_rounds_with_overlap_and_fragments_are_the_direct_ones(tmp_path):
    settings = dict(SETTINGS, steps=6, inner_steps=4, fragments=2, overlap=True)
    direct = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "d")), in_process_clients(3))
    relayed = run_trainer(TrainConfig(**settings, relay="peers", output_dir=str(tmp_path / "r")), in_process_clients(3))
    _same(direct, relayed)
    records = read_metrics(tmp_path / "r")
    assert sum(r["bytes_pulled"] for r in records) > 0 and not any(r["relay_resent"] for r in records)


@pytest.mark.parametrize("changes", [{"downlink": "compressed"}, {"outer_optimizer": "adamw", "downlink": "auto"}])
def test_a_compressed_aggregate_goes_to_fanout_workers_and_the_rest_pull_it_down_a_tree(tmp_path, changes):
    """Six workers, the compressed downlink (or adamw's compressed delta): the coordinator sends it to
    --relay-fanout 2 of them, the other four pull it from those (or from one that pulled it), and the run is
    the direct one."""
    settings = dict(SETTINGS, steps=4, **changes)
    direct = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "d")), in_process_clients(6))
    relayed = run_trainer(TrainConfig(**settings, relay="peers", output_dir=str(tmp_path / "r")), in_process_clients(6))
    _same(direct, relayed)
    a, b = read_metrics(tmp_path / "d"), read_metrics(tmp_path / "r")
    for before, after in zip(a[1:], b[1:]):
        aggregate = (before["bytes_down"] - after["bytes_down"]) / 4  # four orders carry it no more
        # each pull's reply frames the piece in up to 128 bytes more than an order does
        assert after["bytes_pulled"] == pytest.approx(4 * aggregate, rel=0.01, abs=4 * 128)
        assert after["relay_resent"] == 0
        assert after["bytes_down"] < 2 * aggregate + 6 * 10_000  # two aggregates and six small orders


def test_a_worker_that_missed_rounds_catches_up_pulling_what_it_missed(tmp_path):
    """Worker 2's calls of rounds 3 and 4 are dropped; in round 5 it catches up by replay, and the missed
    updates' payloads come from their senders (who keep them a few rounds) as the round's do."""
    settings = dict(SETTINGS, steps=7)
    runs = {}
    for relay in ("direct", "peers"):
        factories = [lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu"), faulty("drop", rounds={3, 4})]
        with live_workers(3, factories) as workers:
            runs[relay] = train(TrainConfig(**settings, relay=relay, output_dir=str(tmp_path / relay)), workers)
    _same(runs["direct"], runs["peers"])
    direct, relayed = ({r["step"]: r for r in read_metrics(tmp_path / k)} for k in ("direct", "peers"))
    back = 6  # the record of round 5
    assert direct[back]["catch_ups"] == relayed[back]["catch_ups"] == 1 and relayed[back]["pushes"] == 0
    assert relayed[back]["relay_resent"] == 0
    # The catch-up's missed payloads were pulled too: the coordinator sent less than the direct run by them.
    saved = direct[back]["bytes_down"] - relayed[back]["bytes_down"]
    assert relayed[back]["bytes_pulled"] == pytest.approx(saved, rel=0.01)
    # A direct round sends each of the 3 workers the 2 other payloads. The catch-up round relayed sends one:
    # worker 2's own of the last round it sent in, which a catch-up's whole update names no source for.
    payload = direct[back + 1]["bytes_down"] / 6
    assert relayed[back]["bytes_down"] < 2 * payload


def test_the_status_page_counts_what_each_worker_pulled(tmp_path):
    trainer = Trainer(
        TrainConfig(**SETTINGS, steps=3, relay="peers", output_dir=str(tmp_path)), in_process_clients(3), progress=False
    )
    trainer.status = StatusBoard(run={"run_id": trainer.run_id})
    try:
        trainer.run()
    finally:
        trainer.close()
    records, rows = read_metrics(tmp_path), trainer.status.snapshot()["workers"]
    pulled = sum(r["bytes_pulled"] for r in records)
    assert pulled > 0 and sum(r["bytes_pulled"] for r in rows) == pulled
    assert all(r["bytes_pulled"] > 0 for r in rows)  # each pulled the two others' payloads


class _Flipping(WorkerEngine):
    """Serves every relayed payload with one byte flipped."""

    def pull_piece(self, request: PieceRequest) -> bytes:
        data = bytearray(super().pull_piece(request))
        data[len(data) // 2] ^= 0x40
        return bytes(data)


class _Gone(WorkerEngine):
    """Answers every pull as a worker that holds nothing (a restarted one), or one that is gone."""

    def pull_piece(self, request: PieceRequest) -> bytes:
        raise NotHeld("PullPiece: no payload here")


class _Stalling(WorkerEngine):
    """Holds every pull until the test ends (past the puller's deadline)."""

    release = threading.Event()

    def pull_piece(self, request: PieceRequest) -> bytes:
        self.release.wait(30)
        return super().pull_piece(request)


@pytest.mark.parametrize("bad", [_Flipping, _Gone])
def test_a_peer_that_serves_wrong_bytes_or_nothing_costs_a_retry_and_is_named_for_nothing_a_while(tmp_path, bad):
    steps = 4
    settings = dict(SETTINGS, steps=steps)
    direct = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "d")), in_process_clients(3))
    factories = iter([bad, WorkerEngine, WorkerEngine])  # worker 0 is the bad peer
    clients = in_process_clients(3, factory=lambda d: next(factories)(d))
    relayed = run_trainer(TrainConfig(**settings, relay="peers", output_dir=str(tmp_path / "r")), clients)
    _same(direct, relayed)  # every round completed, the same
    records = read_metrics(tmp_path / "r")
    # Round 2 (the first with an update): the others failed to pull worker 0's payload and got it in their
    # orders again (both, or one: an order built after the first failure came in names worker 0 no more);
    # from then on worker 0 is named for nothing (QUIET_ROUNDS), so nobody fails again.
    resent = [r["relay_resent"] for r in records]
    assert resent[0] == 0 and resent[1] in (1, 2) and resent[2:] == [0] * (steps - 2)
    assert steps - 2 < QUIET_ROUNDS
    assert all(r["bytes_pulled"] > 0 for r in records[2:])  # the two good workers' payloads still travel peer to peer


def test_a_bad_link_of_the_aggregates_tree_is_passed_over_and_named(tmp_path):
    """--relay-fanout 1, four workers: 0 gets the aggregate, 1 pulls it from 0, 2 from 1 (else 0), 3 from 2
    (else 0). Worker 1 serves wrong bytes: 2 takes it from 0 and names 1, and the next rounds' tree leaves 1
    out (it gets the aggregate in its order). No order is sent twice, and the run is the direct one."""
    settings = dict(SETTINGS, steps=4, downlink="compressed", relay_fanout=1)
    direct = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "d")), in_process_clients(4))
    factories = iter([WorkerEngine, _Flipping, WorkerEngine, WorkerEngine])
    clients = in_process_clients(4, factory=lambda d: next(factories)(d))
    relayed = run_trainer(TrainConfig(**settings, relay="peers", output_dir=str(tmp_path / "r")), clients)
    _same(direct, relayed)
    records = read_metrics(tmp_path / "r")
    assert [r["relay_failed"] for r in records] == [0, 1, 0, 0]
    assert not any(r["relay_resent"] for r in records)
    assert all(r["bytes_pulled"] > 0 for r in records[1:])


def test_a_peer_that_stalls_past_the_deadline_costs_a_retry(tmp_path):
    settings = dict(SETTINGS, steps=3)
    factories = [_Stalling, WorkerEngine, WorkerEngine]
    try:
        with live_workers(3, factories) as workers:
            for w in workers:
                w.engine.peers.timeout = 1.0  # the pull's deadline
            train(TrainConfig(**settings, relay="peers", output_dir=str(tmp_path / "r")), workers)
    finally:
        _Stalling.release.set()
    records = read_metrics(tmp_path / "r")
    assert len(records) == 3 and records[1]["relay_resent"] in (1, 2) and records[1]["successful_workers"] == 3


def test_under_auto_a_worker_that_reaches_no_peer_gets_its_orders_whole_and_the_others_still_pull(tmp_path):
    """Four workers; worker 0 dials nobody (its pulls all fail) but serves. Under --relay peers its failures
    name every source for nobody a while; under auto it alone is cut off: its orders carry the payloads, and
    the three others pull each other's and worker 0's. Both are the direct run."""
    settings = dict(SETTINGS, steps=5)
    direct = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "d")), in_process_clients(4))
    for relay in ("peers", "auto"):
        clients = in_process_clients(4)
        clients[0].engine.peers = InProcessPeers({})
        _same(direct, run_trainer(TrainConfig(**settings, relay=relay, output_dir=str(tmp_path / relay)), clients))
    auto, peers = read_metrics(tmp_path / "auto"), read_metrics(tmp_path / "peers")
    # Round 2, the first with an update: worker 0 pulled nothing and got its order again, payloads in it.
    assert [r["relay_resent"] for r in auto] == [0, 1, 0, 0, 0]
    for a, p in zip(auto[2:], peers[2:]):  # 3 receivers x 3 payloads, against 3 x worker 0's alone
        assert a["bytes_pulled"] > 2 * p["bytes_pulled"] > 0
