"""Gossip rounds with a multi-GPU node among the workers, on CPU with gloo.

A DDP node of 2 ranks is one member of the graph: every rank keeps the same public copies and own model,
the inner steps' gradient all-reduce keeps them alike, and rank 0 answers for the node. Its round is a
single device's on the node's whole batch (to float noise), and peer-to-peer its rank 0 pulls and hands
the other rank what it pulled: the run is the relayed run bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import model_spec, spec_elements
from gradwire.protocol import WorkerInfo
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.sizing import GB, HEADROOM, state_bytes

from .conftest import live_workers, run_trainer, steps_with_fault
from .test_gossip import EXACT, _config
from .test_node import TIMEOUT, node

pytestmark = pytest.mark.slow


class TwoRanksOnOneDevice(WorkerEngine):
    """A single-device worker that says it is a 2-rank DDP node: the coordinator gives it a node's rows (2 x
    ``--batch-size``), and it computes on all of them at once, as one device would the node's whole batch."""

    def info(self, owner: bytes | None = None) -> WorkerInfo:
        return dataclasses.replace(super().info(owner), ranks=2, rank_devices=("cpu", "cpu"), node_mode="ddp")


def _consensus(trainer) -> dict[str, torch.Tensor]:
    return trainer.gossip.consensus()


def test_a_ddp_node_gossips_as_one_worker_on_its_whole_batch_relayed_and_peer_to_peer(tmp_path):
    settings = dict(topology="ring", steps=4, **EXACT)
    with live_workers(2) as singles, node(tmp_path) as (address, _):

        def clients():
            return [*(w.client() for w in singles), WorkerClient(address, timeout=TIMEOUT)]

        relayed = run_trainer(_config(tmp_path, "relayed", **settings), clients())
        p2p = run_trainer(_config(tmp_path, "p2p", peer_to_peer=True, **settings), clients())
        # A neighbour lost while the node would pull from it: rank 0 answers unreachable and hands its other
        # rank that answer, and the node trains on with the one left.
        trainer = Trainer(_config(tmp_path, "lost", peer_to_peer=True, **settings), clients(), progress=False)
        lost = steps_with_fault(trainer, lambda: singles[0].server.stop(grace=None), before=2, after=4)
    factories = [lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu"), lambda: TwoRanksOnOneDevice("cpu")]
    with live_workers(3, factories) as workers:
        alone = run_trainer(_config(tmp_path, "alone", **settings), [w.client() for w in workers])

    records, p2p_records = read_metrics(tmp_path / "relayed"), read_metrics(tmp_path / "p2p")
    reference = read_metrics(tmp_path / "alone")
    assert [r["successful_workers"] for r in records + p2p_records] == [3] * 8  # every round, every member
    assert all(r["ranks"] == 4 for r in records + reference)  # 1 + 1 + the node's 2
    assert records[-1]["total_tokens"] == reference[-1]["total_tokens"]
    # The node's round is one device's on its whole batch: DDP's all-reduce only adds float noise.
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    for k, v in _consensus(alone).items():
        torch.testing.assert_close(_consensus(relayed)[k], v, atol=1e-5, rtol=0, msg=k)
    # Peer-to-peer the node's rank 0 pulls for both ranks: the same run, bit for bit.
    assert [r["loss"] for r in p2p_records] == [r["loss"] for r in records]
    assert all(set(r["pulled_payloads"].values()) == {2} for r in p2p_records[1:])
    assert all(set(r["relayed_payloads"].values()) == {0} for r in p2p_records[1:])
    for k, v in _consensus(relayed).items():
        assert torch.equal(_consensus(p2p)[k], v), k
    assert [r is not None and r["successful_workers"] for r in lost[:2]] == [3, 3]
    assert [r is not None and r["successful_workers"] for r in lost[-2:]] == [2, 2]  # the node and the other


def test_a_local_sgd_node_gossips_and_its_peer_to_peer_run_is_its_relayed_run(tmp_path):
    """--node-mode local-sgd: the ranks step apart and average their models at the end of the inner steps, so
    every rank again sends the same message; compressed gossip trains, and pulling is relaying bit for bit."""
    settings = dict(topology="ring", steps=4, inner_optimizer="demuon", inner_learning_rate=0.02)
    with live_workers(2) as singles, node(tmp_path, "--node-mode", "local-sgd") as (address, _):

        def clients():
            return [*(w.client() for w in singles), WorkerClient(address, timeout=TIMEOUT)]

        relayed = run_trainer(_config(tmp_path, "relayed", **settings), clients())
        p2p = run_trainer(_config(tmp_path, "p2p", peer_to_peer=True, **settings), clients())
    records, p2p_records = read_metrics(tmp_path / "relayed"), read_metrics(tmp_path / "p2p")
    assert [r["successful_workers"] for r in records + p2p_records] == [3] * 8
    assert records[-1]["loss"] < records[0]["loss"]
    assert [r["loss"] for r in p2p_records] == [r["loss"] for r in records]
    for k, v in _consensus(relayed).items():
        assert torch.equal(_consensus(p2p)[k], v), k


def test_an_auto_node_too_small_for_the_whole_state_gossips_with_zero1(tmp_path):
    """A gossip run's push says it gossips: an auto node whose ranks cannot hold the whole model's state
    (which would make a plain run's node fsdp, split) picks ZeRO-1, where every rank holds the whole model
    and only the inner optimizer's state is split. It computes as a DDP node: the single device's rounds on
    its whole batch, to float noise."""
    settings = dict(topology="ring", steps=3, **EXACT)
    config = _config(tmp_path, "zero1", **settings)
    elements, momentum = spec_elements(model_spec(config.model)), config.momentum > 0
    whole = sum(state_bytes(elements, momentum=momentum, local_sgd=True).values())
    zero1 = sum(state_bytes(elements, momentum=momentum, local_sgd=True, inner_shards=2).values())
    memory = f"{(whole + zero1) / 2 / HEADROOM / GB:.9f}"  # ZeRO-1's share fits a rank, the whole state does not
    with live_workers(2) as singles, node(tmp_path, "--rank-memory-gb", memory) as (address, _):
        trainer = run_trainer(config, [*(w.client() for w in singles), WorkerClient(address, timeout=TIMEOUT)])
    assert trainer.roster.slots[-1].node_mode == "fsdp:optimizer"
    factories = [lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu"), lambda: TwoRanksOnOneDevice("cpu")]
    with live_workers(3, factories) as workers:
        alone = run_trainer(_config(tmp_path, "alone", **settings), [w.client() for w in workers])
    records, reference = read_metrics(tmp_path / "zero1"), read_metrics(tmp_path / "alone")
    assert [r["successful_workers"] for r in records] == [3] * 3
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    for k, v in _consensus(alone).items():
        torch.testing.assert_close(_consensus(trainer)[k], v, atol=1e-5, rtol=0, msg=k)
