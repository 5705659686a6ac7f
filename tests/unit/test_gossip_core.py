"""Gossip's pure pieces: the graphs and their weights, CHOCO's mixing step, and how fast it agrees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.gossip.choco import consensus_distance, difference, mix, receive
from gradwire.gossip.topology import GOSSIP_TOPOLOGIES, graph, spectral_gap


def members(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


@pytest.mark.parametrize("kind", GOSSIP_TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13])
def test_weights_are_symmetric_doubly_stochastic_and_follow_the_edges(kind: str, n: int) -> None:
    g = graph(kind, members(n))
    w = g.matrix()
    assert np.allclose(w, w.T) and np.allclose(w.sum(axis=0), 1) and np.allclose(w.sum(axis=1), 1)
    assert (w >= -1e-12).all()
    for i in range(n):
        assert i not in g.neighbours[i]
        for j in range(n):
            assert (w[i, j] > 0) == (i == j or j in g.neighbours[i]), (i, j)


def test_degrees_of_each_graph() -> None:
    assert [graph("ring", members(n)).degree(0) for n in (1, 2, 3, 8)] == [0, 1, 2, 2]
    assert [graph("complete", members(n)).degree(0) for n in (1, 2, 5, 8)] == [0, 1, 4, 7]
    # i +- 1, 2, 4 on 8 members: 4 steps either way is one neighbour.
    assert graph("exponential", members(8)).neighbours[0] == (1, 2, 4, 6, 7)
    assert graph("exponential", members(16)).degree(3) == 7
    assert np.allclose(graph("complete", members(6)).matrix(), np.full((6, 6), 1 / 6))


def test_a_leaving_member_relinks_its_neighbours_and_a_joining_one_goes_last() -> None:
    ring = graph("ring", members(5))
    assert ring.neighbours_of("w2") == ("w1", "w3")
    without = graph("ring", [m for m in members(5) if m != "w2"])
    assert without.neighbours_of("w1") == ("w0", "w3") and without.neighbours_of("w3") == ("w1", "w4")
    joined = graph("ring", [*members(4), "new"])
    assert joined.neighbours_of("new") == ("w0", "w3")
    assert joined.weights_of("new") == {"w0": 1 / 3, "w3": 1 / 3}
    with pytest.raises(ValueError, match="distinct"):
        graph("ring", ["a", "a"])
    with pytest.raises(ValueError, match="gossip topology"):
        graph("star", members(3))


def test_spectral_gaps_order_the_graphs() -> None:
    gaps = {kind: spectral_gap(graph(kind, members(8)).matrix()) for kind in GOSSIP_TOPOLOGIES}
    assert gaps["complete"] == pytest.approx(1.0)
    assert gaps["ring"] < gaps["exponential"] < gaps["complete"]
    # The ring's W is circulant: eigenvalues 1/3 + 2/3 cos(2 pi k / n).
    assert gaps["ring"] == pytest.approx(1 - (1 / 3 + 2 / 3 * np.cos(2 * np.pi / 8)))


def _models(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g)} for _ in range(n)]


def _gossip_round(kind: str, models: list[dict[str, torch.Tensor]], publics, gamma: float, compress) -> None:
    """One CHOCO round of every node, as the nodes would run it: send, receive, then mix."""
    g = graph(kind, members(len(models)))
    qs = [compress(difference(m, p)) for m, p in zip(models, publics)]
    for p, q in zip(publics, qs):
        receive(p, q)
    for i, m in enumerate(models):
        peers = {g.members[j]: publics[j] for j in g.neighbours[i]}
        mix(m, publics[i], peers, g.weights_of(g.members[i]), gamma)


def test_exact_gossip_on_the_complete_graph_with_gamma_1_is_averaging() -> None:
    models = _models(5)
    mean = {k: torch.stack([m[k] for m in models]).mean(0) for k in models[0]}
    publics = [{k: torch.zeros_like(t) for k, t in m.items()} for m in models]
    _gossip_round("complete", models, publics, 1.0, lambda d: d)
    for m in models:
        for k in m:
            assert torch.allclose(m[k], mean[k], atol=1e-6)
    assert consensus_distance(models) < 1e-10


@pytest.mark.parametrize("kind", GOSSIP_TOPOLOGIES)
def test_exact_gossip_shrinks_the_consensus_distance_at_the_spectral_rate(kind: str) -> None:
    models = _models(8, seed=1)
    mean_before = {k: torch.stack([m[k] for m in models]).mean(0) for k in models[0]}
    rate = (1 - spectral_gap(graph(kind, members(8)).matrix())) ** 2
    publics = [{k: torch.zeros_like(t) for k, t in m.items()} for m in models]
    distance = consensus_distance(models)
    for _ in range(5):
        _gossip_round(kind, models, publics, 1.0, lambda d: d)
        now = consensus_distance(models)
        assert now <= rate * distance * (1 + 1e-6) + 1e-12, (now, distance, rate)
        distance = now
    for k in mean_before:  # mixing keeps the mean
        assert torch.allclose(torch.stack([m[k] for m in models]).mean(0), mean_before[k], atol=1e-5)


def _top_half(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A crude compressor: the larger half of each tensor's entries by magnitude, the rest zero."""
    out = {}
    for k, t in d.items():
        flat = t.reshape(-1)
        keep = flat.abs().topk(max(1, flat.numel() // 2)).indices
        out[k] = torch.zeros_like(flat).index_copy_(0, keep, flat[keep]).view_as(t)
    return out


def test_compressed_gossip_on_a_ring_agrees_and_keeps_the_mean() -> None:
    models = _models(4, seed=2)
    mean_before = {k: torch.stack([m[k] for m in models]).mean(0) for k in models[0]}
    publics = [{k: torch.zeros_like(t) for k, t in m.items()} for m in models]
    start = consensus_distance(models)
    for _ in range(60):
        _gossip_round("ring", models, publics, 0.5, _top_half)
    assert consensus_distance(models) < 1e-3 * start
    for k in mean_before:
        assert torch.allclose(torch.stack([m[k] for m in models]).mean(0), mean_before[k], atol=1e-5)


def test_mix_refuses_mismatched_neighbours_and_a_bad_gamma() -> None:
    m = _models(1)[0]
    with pytest.raises(ValueError, match="weights"):
        mix(m, m, {"a": m}, {"b": 0.5}, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        mix(m, m, {"a": m}, {"a": 0.5}, 0.0)
