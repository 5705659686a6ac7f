"""Gossip rounds' cores without a network: the links on the wire (round trip, and what is refused before
anything is allocated for it), the coordinator's ``GossipRounds`` and the worker's ``take_links`` /
``mix`` / ``send`` driven against each other by hand, including a worker that misses a round and one
that leaves."""

from __future__ import annotations

import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec
from gradwire.coordinator.gossip import GossipRounds
from gradwire.gossip.choco import consensus_distance
from gradwire.protocol import (
    OK,
    GossipLinks,
    ProtocolError,
    RoundResult,
    gossip_from_proto,
    gossip_to_proto,
)
from gradwire.worker import gossip as worker_gossip

SHAPES = {"w": (64, 64), "b": (64,)}
CODEC = GradientCodec(SHAPES, CodecConfig(topk=512, bins=16, min_sparse_numel=65))


def start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def test_links_round_trip_on_the_wire() -> None:
    payload = CODEC.compress({k: torch.ones(s) for k, s in SHAPES.items()})
    links = GossipLinks(
        "a",
        {"b": 0.25, "c": 0.5},
        0.5,
        own_accepted=True,
        relays={"b": payload},
        fresh={"c": {k: torch.zeros(s) for k, s in SHAPES.items()}, "a": None},
        drop=("d",),
    )
    back = gossip_from_proto(gossip_to_proto(links))
    assert (back.member, dict(back.weights), back.gamma, back.own_accepted) == ("a", {"b": 0.25, "c": 0.5}, 0.5, True)
    assert back.relays == {"b": payload} and back.drop == ("d",) and back.fresh["a"] is None
    assert all(torch.equal(back.fresh["c"][k], torch.zeros(s)) for k, s in SHAPES.items())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(gamma=0.0), "gamma"),
        (dict(gamma=float("nan")), "gamma"),
        (dict(weights={"b": 0.7, "c": 0.7}), "sum to"),
        (dict(weights={"a": 0.5}), "own neighbour"),
        (dict(weights={"b": -0.1}), "weight"),
        (dict(relays={"z": None}), "non-neighbours"),
        (dict(fresh={"z": None}), "non-neighbours"),
        (dict(drop=("b",)), "drop"),
        (dict(member=""), "member name"),
        (dict(member="x" * 500), "member name"),
    ],
)
def test_malformed_links_are_refused_clearly(change: dict, match: str) -> None:
    fields = dict(member="a", weights={"b": 0.25, "c": 0.25}, gamma=0.5)
    with pytest.raises(ProtocolError, match=match):
        GossipLinks(**{**fields, **change})


def test_links_with_a_member_twice_or_a_start_with_tensors_are_refused_on_the_wire() -> None:
    msg = gossip_to_proto(GossipLinks("a", {"b": 0.5}, 1.0))
    msg.neighbours.add(member="b", weight=0.1)
    with pytest.raises(ProtocolError, match="twice"):
        gossip_from_proto(msg)
    msg = gossip_to_proto(GossipLinks("a", {"b": 0.5}, 1.0, fresh={"b": None}))
    msg.fresh[0].tensors.add(name="w")
    with pytest.raises(ProtocolError, match="is the start and carries tensors"):
        gossip_from_proto(msg)


class Worker:
    """A worker's gossip state and its own model, as ``WorkerEngine._gossip_round`` drives them (no training:
    ``drift`` stands in for the inner steps)."""

    def __init__(self) -> None:
        self.state: worker_gossip.GossipState | None = None
        self.model = {k: torch.full(s, float("nan")) for k, s in SHAPES.items()}  # set from its own copy

    def round(self, links: GossipLinks, drift: float, seed: int) -> RoundResult:
        self.state = worker_gossip.take_links(self.state, links, self.model, START, CODEC)
        worker_gossip.mix(self.state, links, self.model)
        g = torch.Generator().manual_seed(seed)
        for t in self.model.values():
            t.add_(drift * torch.randn(t.shape, generator=g))
        payload, residual = worker_gossip.send(self.state, self.model, CODEC)
        return RoundResult(OK, 0, gradient=payload, gossip_residual=residual)


START = start()


def _run(rounds, workers, present, drift=0.05, absent=()):
    coordinator = GossipRounds("ring", 0.5, START)
    history = []
    for r in range(rounds):
        members = [m for m in present(r) if m not in absent(r)] if callable(absent) else present(r)
        coordinator.leave(present(r))
        links = coordinator.links(members)
        results = {m: workers[m].round(links[m], drift, 100 * r + i) for i, m in enumerate(members)}
        history.append((links, coordinator.finish(results, CODEC)))
    return coordinator, history


def _copies_match(coordinator: GossipRounds, workers: dict[str, Worker], members) -> None:
    """Each worker's copies are the coordinator's once it adds the last accepted messages (as it will)."""
    for m in members:
        node, pending = workers[m].state.node, workers[m].state.pending
        own = {k: v + pending[k] for k, v in node.own.items()} if m in coordinator.accepted else node.own
        assert all(torch.equal(own[k], coordinator.copies.copy_of(m)[k]) for k in own), m
        for j, copy in node.copies.items():
            q = CODEC.decompress(coordinator.accepted[j]) if j in coordinator.accepted else None
            want = {k: v + q[k] for k, v in copy.items()} if q is not None else copy
            assert all(torch.equal(want[k], coordinator.copies.copy_of(j)[k]) for k in want), (m, j)


def test_a_ring_of_four_keeps_every_copy_in_step_and_starts_from_the_start_without_sending_it() -> None:
    workers = {m: Worker() for m in "abcd"}
    coordinator, history = _run(12, workers, lambda r: list("abcd"))
    first_links, _ = history[0]
    assert all(links.fresh == {m: None for m in (*links.weights, m)} for m, links in first_links.items())
    later, finish = history[-1]
    assert all(not links.fresh and len(links.relays) == 2 and links.own_accepted for links in later.values())
    assert finish.accepted == tuple("abcd") and not finish.refused
    _copies_match(coordinator, workers, "abcd")
    models = [workers[m].model for m in "abcd"]
    assert finish.consensus_distance < 2 * consensus_distance(models) + 1e-3  # the copies track the models


def test_a_worker_that_misses_a_round_gets_every_copy_whole() -> None:
    workers = {m: Worker() for m in "abcd"}
    coordinator, history = _run(8, workers, lambda r: list("abcd"), absent=lambda r: ("b",) if r == 4 else ())
    links_5, _ = history[5]
    assert set(links_5["b"].fresh) == {"a", "b", "c"} and not links_5["b"].relays
    assert all(v is not None for v in links_5["b"].fresh.values())  # the copies moved: sent whole
    # Round 4's graph was a ring of a, c, d: a held c's copy then, drops it now and takes b's again, whole.
    assert (set(links_5["a"].fresh), set(links_5["a"].relays), links_5["a"].drop) == ({"b"}, {"d"}, ("c",))
    _copies_match(coordinator, workers, "abcd")


def test_a_worker_sent_every_copy_whole_forgets_the_copies_of_members_no_longer_its_neighbours() -> None:
    """b misses round 4, so the coordinator no longer knows what it holds and sends it every copy whole in
    round 5; c sits round 5 out, so b's neighbours then are a and d alone. b still holds c's copy from round
    3: it keeps only its neighbours' (the coordinator could not have told it to drop c's)."""
    workers = {m: Worker() for m in "abcd"}
    absent = lambda r: ("b",) if r == 4 else ("c",) if r == 5 else ()  # noqa: E731
    coordinator, history = _run(8, workers, lambda r: list("abcd"), absent=absent)
    links_5, finish_5 = history[5]
    assert set(links_5["b"].weights) == {"a", "d"} and set(links_5["b"].fresh) == {"a", "b", "d"}
    assert "c" not in links_5["b"].drop and finish_5.accepted == tuple("abd")
    _copies_match(coordinator, workers, "abcd")


def test_a_member_that_leaves_is_dropped_and_a_joiner_starts_from_the_consensus() -> None:
    workers = {m: Worker() for m in "abcde"}
    present = lambda r: list("abcd") if r < 4 else list("acd") if r < 7 else list("acde")  # noqa: E731
    coordinator, history = _run(10, workers, present)
    links_4, _ = history[4]
    assert links_4["a"].drop == ("b",) and set(links_4["a"].weights) == {"c", "d"}  # re-linked: a ring of 3
    assert "c" in links_4["a"].relays or "c" in links_4["a"].fresh
    links_7, _ = history[7]
    consensus_at_join = links_7["e"].fresh["e"]
    assert consensus_at_join is not None and set(links_7["e"].fresh) == {"a", "d", "e"}
    _copies_match(coordinator, workers, "acde")
    assert "b" not in coordinator.copies


def test_a_message_that_does_not_decode_is_refused_and_its_sender_keeps_its_copy() -> None:
    coordinator = GossipRounds("ring", 0.5, START)
    links = coordinator.links(["a", "b", "c"])
    bad = GradientCodec(SHAPES, CodecConfig(topk=16)).compress({k: torch.ones(s) for k, s in SHAPES.items()})
    good = CODEC.compress({k: torch.ones(s) for k, s in SHAPES.items()})
    finish = coordinator.finish(
        {"a": RoundResult(OK, 0, gradient=bad), "b": RoundResult(OK, 0, gradient=good), "c": None}, CODEC
    )
    assert finish.accepted == ("b",) and "codec settings" in finish.refused["a"] and "no answer" in finish.refused["c"]
    assert all(torch.equal(coordinator.copies.copy_of("a")[k], START[k]) for k in START)
    links = coordinator.links(["a", "b", "c"])
    assert not links["a"].own_accepted and "a" not in links["c"].relays and links["c"].fresh  # c missed it
    assert set(links["a"].relays) == {"b"}


def test_its_own_copy_sent_again_replaces_the_copy_voids_the_unaccepted_message_and_keeps_the_model() -> None:
    worker = Worker()
    worker.round(GossipLinks("a", {"b": 0.5}, 0.5, fresh={"a": None, "b": None}), drift=0.1, seed=1)
    model = {k: v.clone() for k, v in worker.model.items()}
    assert worker.state.pending is not None
    moved = {k: v + 1 for k, v in START.items()}
    worker.state = worker_gossip.take_links(
        worker.state, GossipLinks("a", {"b": 0.5}, 0.5, fresh={"a": moved}), worker.model, START, CODEC
    )
    assert worker.state.pending is None and all(torch.equal(worker.state.node.own[k], moved[k]) for k in moved)
    assert all(torch.equal(worker.model[k], model[k]) for k in model)  # its own model is its own
    with pytest.raises(ProtocolError, match="own public copy must come whole"):
        worker_gossip.take_links(None, GossipLinks("a", {"b": 0.5}, 0.5, fresh={"b": None}), worker.model, START, CODEC)
    with pytest.raises(ProtocolError, match="does not hold"):
        worker_gossip.take_links(
            worker.state,
            GossipLinks("a", {"c": 0.5}, 0.5, relays={"c": CODEC.compress(START)}, drop=("b",)),
            worker.model,
            START,
            CODEC,
        )
