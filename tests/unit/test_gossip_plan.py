"""The coordinator's gossip planning: relays, whole copies on (re-)linking, and the consensus of the copies."""

from __future__ import annotations

import pytest
import torch

from gradwire.coordinator.gossip import PublicCopies, plan_links
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
