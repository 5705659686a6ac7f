"""Gossip rounds without a network: the coordinator's planning and public copies, and each node's copies, messages and
mixing, kept identical at every holder."""

from __future__ import annotations

import pytest
import torch

from gradwire.compression.codec import GradientCodec
from gradwire.compression.config import CodecConfig
from gradwire.coordinator.gossip import GossipRounds, PublicCopies, plan_links
from gradwire.gossip.choco import consensus_distance
from gradwire.gossip.node import GossipNode
from gradwire.gossip.topology import graph


def test_a_steady_ring_relays_only() -> None:
    g = graph("ring", ["a", "b", "c", "d"])
    held = {m: frozenset(g.neighbours_of(m)) for m in g.members}
    plans = plan_links(g, held)
    assert plans["a"].relay == ("b", "d") and plans["a"].fresh == () and plans["a"].drop == ()
    assert plans["a"].weights == {"b": 1 / 3, "d": 1 / 3}
    assert "relays only" in plans["a"].why


def test_a_leaver_relinks_its_neighbours_with_whole_copies_and_a_joiner_gets_its_own() -> None:
    before = graph("ring", ["a", "b", "c", "d"])
    held = {m: frozenset(before.neighbours_of(m)) for m in before.members}
    after = graph("ring", ["a", "b", "d", "e"])  # c left, e joined
    plans = plan_links(after, {m: h for m, h in held.items() if m != "c"})
    assert plans["b"].neighbours == ("a", "d") and plans["b"].fresh == ("d",) and plans["b"].drop == ("c",)
    assert plans["d"].neighbours == ("b", "e") and plans["d"].fresh == ("b", "e") and plans["d"].drop == ("a", "c")
    assert plans["e"].fresh == ("a", "d") and plans["e"].relay == () and "joins" in plans["e"].why
    assert "re-linked" in plans["b"].why


def test_public_copies_take_messages_and_average_into_the_consensus() -> None:
    copies = PublicCopies()
    copies.add("a", {"w": torch.zeros(3)})
    copies.add("b", {"w": torch.ones(3)})
    copies.receive("a", {"w": torch.tensor([2.0, 0.0, 0.0])})
    assert torch.equal(copies.consensus()["w"], torch.tensor([1.5, 0.5, 0.5]))
    copies.remove("a")
    assert copies.members == ("b",) and torch.equal(copies.consensus()["w"], torch.ones(3))
    with pytest.raises(ValueError, match="already"):
        copies.add("b", {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="every tensor"):
        copies.receive("b", {})


def _ring_run(rounds: int, codec, gamma: float, members: list[str], seed: int = 0):
    """Nodes on a ring, no training: each round every node sends, the coordinator relays, every node
    receives its neighbours' messages and mixes. Returns the nodes, their models and the coordinator's copies."""
    g = torch.Generator().manual_seed(seed)
    models = {m: {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)} for m in members}
    ring = graph("ring", members)
    nodes = {m: GossipNode(m, models[m]) for m in members}
    coordinator = PublicCopies()
    for m in members:
        coordinator.add(m, models[m])
    plans = plan_links(ring, {})
    for m, node in nodes.items():
        node.link({j: coordinator.copy_of(j) for j in plans[m].fresh})
    distances = [consensus_distance(list(models.values()))]
    for _ in range(rounds):
        messages = {}
        for m, node in nodes.items():
            _, messages[m] = node.send(models[m], codec)
            node.accept(messages[m])
            coordinator.receive(m, messages[m])
        for m, node in nodes.items():
            for j in plans[m].neighbours:
                node.receive(j, messages[j])
            node.mix(models[m], plans[m].weights, gamma)
        distances.append(consensus_distance(list(models.values())))
    return nodes, models, coordinator, distances


def test_compressed_gossip_keeps_every_holders_copies_identical_and_agrees() -> None:
    members = ["a", "b", "c", "d"]
    codec = GradientCodec({"w": (64, 64), "b": (64,)}, CodecConfig(topk=512, bins=16, min_sparse_numel=65))
    nodes, models, coordinator, distances = _ring_run(40, codec, 0.5, members)
    for m, node in nodes.items():
        assert all(torch.equal(node.own[k], coordinator.copy_of(m)[k]) for k in node.own)
        for j, copy in node.copies.items():
            assert all(torch.equal(copy[k], coordinator.copy_of(j)[k]) for k in copy), (m, j)
    assert distances[-1] < 0.05 * distances[0], distances
    assert max(distances) <= distances[0] * 1.0001


def test_gossip_node_state_round_trips_and_refuses_bad_state() -> None:
    codec = GradientCodec({"w": (64, 64), "b": (64,)}, CodecConfig(topk=512, bins=16, min_sparse_numel=65))
    nodes, models, _, _ = _ring_run(3, codec, 0.5, ["a", "b", "c"])
    state = nodes["a"].state_tensors()
    assert set(state) == {"own/w", "own/b", "copy/b/w", "copy/b/b", "copy/c/w", "copy/c/b"}
    restored = GossipNode("a", models["a"])
    restored.load_state_tensors(state)
    assert restored.neighbours == ("b", "c")
    assert all(torch.equal(restored.state_tensors()[k], v) for k, v in state.items())
    for bad in ({"mine/w": torch.zeros(64, 64)}, {**state, "copy/b/w": torch.zeros(3)}):
        with pytest.raises(ValueError, match="gossip state"):
            restored.load_state_tensors(bad)
    assert all(torch.equal(restored.state_tensors()[k], v) for k, v in state.items())  # nothing changed


def test_the_coordinators_gossip_state_survives_a_checkpoint_and_sends_every_copy_whole_after() -> None:
    start = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    rounds = GossipRounds("ring", 0.5, start)
    rounds.links(["0", "1", "2"])
    rounds.copies.receive("1", {"w": torch.ones(4, 4), "b": torch.ones(4)})
    rounds.at_start.discard("1")
    rounds.held = {m: frozenset({"0", "1", "2"}) for m in ("0", "1", "2")}
    groups, meta = rounds.checkpoint()
    resumed = GossipRounds("ring", 0.5, start)
    resumed.restore(groups, meta)
    assert resumed.copies.members == ("0", "1", "2") and resumed.at_start == {"0", "2"}
    assert all(torch.equal(resumed.consensus()[k], v) for k, v in rounds.consensus().items())
    links = resumed.links(["0", "1", "2"])  # fresh workers: every copy whole, their own too; nothing relayed
    assert all(set(links[m].fresh) == {"0", "1", "2"} and not links[m].relays for m in links)
    assert torch.equal(links["0"].fresh["1"]["w"], torch.ones(4, 4)) and links["0"].fresh["0"] is None  # at start
    with pytest.raises(ValueError, match="does not fit"):
        bad = {"gossip-copies": {**groups["gossip-copies"], "1/b": torch.ones(5)}}
        GossipRounds("ring", 0.5, start).restore(bad, meta)
