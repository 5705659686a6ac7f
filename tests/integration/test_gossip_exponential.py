"""The exponential gossip graph (``--topology exponential``) through the service: real gRPC workers, the
coordinator as relay. Six workers, so the graph is neither the ring nor complete: each worker is linked to
those 1 and 2 places either side of it (degree 4, not the 3 that is everyone else's opposite)."""

from __future__ import annotations

import pytest

from gradwire.coordinator.metrics import read_metrics
from gradwire.gossip.topology import graph

from .conftest import live_workers, train
from .test_gossip import _config, _holders_agree

pytestmark = pytest.mark.slow  # two runs of six workers


def test_the_exponential_graph_trains_through_the_service_and_mixes_faster_than_a_ring(tmp_path):
    settings = dict(steps=6, inner_optimizer="demuon", inner_learning_rate=0.02)
    records = {}
    for topology in ("exponential", "ring"):
        with live_workers(6) as workers:
            trainer = train(_config(tmp_path, topology, topology=topology, **settings), workers)
            _holders_agree(trainer, workers)  # every public copy is the coordinator's, bit for bit
        records[topology] = read_metrics(tmp_path / topology)
        if topology == "exponential":
            members = [str(i) for i in range(6)]
            assert trainer.gossip.graph == graph("exponential", members)
            assert trainer.gossip.graph.neighbours_of("0") == ("1", "2", "4", "5")
    exponential, ring = records["exponential"], records["ring"]
    assert all(r["degree_max"] == 4 for r in exponential) and all(r["degree_max"] == 2 for r in ring)
    # From the second round on, each worker's order relays its 4 neighbours' messages of the round before.
    assert all(set(r["relayed_payloads"].values()) == {4} for r in exponential[1:])
    assert exponential[-1]["loss"] < exponential[0]["loss"] - 0.3  # it trains (8.98 -> 8.58)
    # Spectral gap 0.8 against the ring's 1/3: once mixing starts the workers' models stay closer together,
    # and their distance levels off well below the ring's (2.8 against 4.8 after six rounds).
    distances = [(e["consensus_distance"], r["consensus_distance"]) for e, r in zip(exponential[1:], ring[1:])]
    assert all(e < r for e, r in distances) and distances[-1][0] < 0.75 * distances[-1][1], distances
