"""Peer-to-peer gossip's cores without a network: the coordinator's ``GossipRounds`` that sees digests, the
workers' ``take_links`` fed with messages pulled from each other's ``message_piece``, and the copies the
coordinator pulls with ``copy_at``, driven against each other by hand: a ring in step, a worker that misses
a round, one that loses its state, one that leaves and one that joins; pairs that cannot reach each other
(a tunnelled worker, a failed pull) exchange through the coordinator. Then what a pull is refused for, the
links and results on the wire, and the count sketch's estimate."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, GradientCodec
from gradwire.coordinator.gossip import RELAY_ROUNDS, CopiesUnavailable, GossipRounds, route, route_changes
from gradwire.errors import AccessDenied, NotHeld
from gradwire.gossip import choco, sketch
from gradwire.gossip.topology import graph
from gradwire.protocol import (
    OK,
    UNREACHABLE,
    GossipLinks,
    GossipPull,
    GossipSent,
    ProtocolError,
    RoundResult,
    gossip_from_proto,
    gossip_to_proto,
    result_from_proto,
    result_to_proto,
)
from gradwire.worker import gossip as worker_gossip

SHAPES = {"w": (64, 64), "b": (64,)}
CODEC = GradientCodec(SHAPES, CodecConfig(topk=512, bins=16, min_sparse_numel=65))
START = {k: torch.randn(s, generator=torch.Generator().manual_seed(0)) for k, s in SHAPES.items()}


class Peer:
    """A peer-to-peer worker as ``WorkerEngine._gossip_round`` drives it: pull, take the links, mix, drift
    (for the inner steps), send and keep the message."""

    def __init__(self) -> None:
        self.state: worker_gossip.GossipState | None = None
        self.model = {k: torch.full(s, float("nan")) for k, s in SHAPES.items()}
        self.blocked: set[str] = set()  # neighbours it cannot reach
        self.corrupt = None  # what it does to its messages before it keeps and reports them, if anything

    def round(self, links: GossipLinks, round_: int, peers: dict[str, Peer], seed: int) -> RoundResult:
        if cut := tuple(j for j in links.pulls if j in self.blocked):
            return RoundResult(UNREACHABLE, round_, "no route", unreachable_peers=cut)
        pulled = {}
        for j, pull in links.pulls.items():
            data = worker_gossip.message_piece(peers[j].state, links.peer_key, pull.round)
            assert hashlib.sha256(data).digest() == pull.digest
            pulled[j] = protocol.message_from_piece(data, j, pull.round)
        pulls = links.pulls
        links = dataclasses.replace(links, relays={**links.relays, **pulled}, pulls={})  # as the engine does
        try:
            self.state = worker_gossip.take_links(self.state, links, self.model, START, CODEC, round_=round_)
        except worker_gossip.BadMessage as e:
            assert e.member in pulls
            return RoundResult(UNREACHABLE, round_, str(e), unreachable_peers=(e.member,))
        worker_gossip.mix(self.state, links, self.model)
        g = torch.Generator().manual_seed(seed)
        for t in self.model.values():
            t.add_(0.05 * torch.randn(t.shape, generator=g))
        payload, residual = worker_gossip.send(self.state, self.model, CODEC)
        if self.corrupt is not None:
            payload = self.corrupt(payload)
        sent = worker_gossip.keep_for_peers(self.state, round_, payload, START)
        uploaded = payload if links.upload else None
        return RoundResult(OK, round_, gradient=uploaded, gossip_residual=residual, gossip_sent=sent)


def _pull(peers: dict[str, Peer], coordinator: GossipRounds, round_: int, log: list[str]):
    def pull(members):
        out = {}
        for m in members:
            log.append(m)
            try:
                out[m] = worker_gossip.copy_at(peers[m].state, coordinator.peer_key, round_, coordinator.last(m))
            except (NotHeld, AccessDenied, AttributeError):
                pass
        return out

    return pull


def _run(
    coordinator: GossipRounds,
    peers: dict[str, Peer],
    rounds: range,
    present,
    absent=lambda r: (),
    address=lambda m: f"host-{m}:1",
):
    """Rounds as ``GossipTrainer.train_step`` drives them: links, every worker's round, an unreachable
    answer reported and taken as no answer, finish."""
    history, pulled = [], []
    for r in rounds:
        members = [m for m in present(r) if m not in absent(r)]
        coordinator.leave(present(r))
        addresses = {m: address(m) for m in members}
        links = coordinator.links(members, addresses, _pull(peers, coordinator, r, pulled), r)
        results = {m: peers[m].round(links[m], r, peers, 100 * r + i) for i, m in enumerate(members)}
        for m, result in results.items():
            if result.status == UNREACHABLE:
                coordinator.unreachable(m, result.unreachable_peers, r)
        usable = {m: result if result.status == OK else None for m, result in results.items()}
        history.append((links, coordinator.finish(usable, CODEC), list(pulled)))
        pulled.clear()
    return history


def _same_as_pulling_everywhere(peers: dict[str, Peer], rounds: int, **kwargs) -> None:
    """Every worker's own model and copies equal those of a ring where every pair pulls, bit for bit."""
    plain = {m: Peer() for m in peers}
    _run(GossipRounds("ring", 0.5, START, peer_to_peer=True), plain, range(rounds), **kwargs)
    for m in peers:
        assert all(torch.equal(peers[m].model[k], plain[m].model[k]) for k in SHAPES), m
        for j, copy in plain[m].state.node.copies.items():
            assert all(torch.equal(peers[m].state.node.copies[j][k], copy[k]) for k in SHAPES), (m, j)


def _caught_up(peer: Peer) -> dict[str, torch.Tensor]:
    """A worker's own copy once its pending message is accepted (as the next order says it is)."""
    state = peer.state
    return {k: v + state.pending[k] for k, v in state.node.own.items()} if state.pending else state.node.own


def _holders_match_owners(peers: dict[str, Peer], members: str) -> None:
    for m in members:
        for j, copy in peers[m].state.node.copies.items():
            q = peers[j].state.pending
            for k, v in copy.items():
                assert torch.equal(v + q[k] if q else v, _caught_up(peers[j])[k]), (m, j, k)


def test_a_ring_in_step_pulls_from_neighbours_and_the_coordinator_never_holds_a_message() -> None:
    peers = {m: Peer() for m in "abcd"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    history = _run(coordinator, peers, range(5), lambda r: list("abcd"))
    later, finish, pulled = history[-1]
    assert not pulled  # nobody needed a copy whole: the coordinator pulled nothing
    assert all(len(links.pulls) == 2 and not links.relays and not links.fresh for links in later.values())
    assert all(links.own_accepted and links.peer_key == coordinator.peer_key for links in later.values())
    assert finish.accepted == tuple("abcd") and not coordinator.accepted  # digests only
    _holders_match_owners(peers, "abcd")
    exact = choco.consensus_distance([_caught_up(peers[m]) for m in "abcd"])
    assert finish.consensus_distance == pytest.approx(exact, rel=0.25)  # from the sketches
    coordinator.refresh(_pull(peers, coordinator, 5, []))  # as evaluation would, between rounds
    for m in "abcd":
        assert all(torch.equal(coordinator.copies.copy_of(m)[k], v) for k, v in _caught_up(peers[m]).items())


def test_a_worker_that_misses_a_round_keeps_its_own_copy_and_its_neighbours_copies_are_pulled_for_it() -> None:
    peers = {m: Peer() for m in "abcd"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    history = _run(coordinator, peers, range(5), lambda r: list("abcd"), absent=lambda r: ("b",) if r == 3 else ())
    links_b, _, pulled_b = history[4]
    assert set(links_b["b"].fresh) == {"a", "c"} and not links_b["b"].pulls  # whole, pulled from a and c
    # b adds the message of round 2 it still holds (its neighbours pulled it in round 3), and its own copy so
    # made is what a and c are sent whole.
    assert (links_b["b"].own_accepted, links_b["b"].own_round) == (True, 2) and sorted(pulled_b) == ["a", "b", "c"]
    assert "b" in links_b["a"].fresh and "b" in links_b["c"].fresh
    _holders_match_owners(peers, "abcd")


def test_a_worker_that_lost_its_state_joins_anew_from_the_consensus() -> None:
    peers = {m: Peer() for m in "abcd"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    _run(coordinator, peers, range(3), lambda r: list("abcd"))
    peers["b"] = Peer()  # restarted: no gossip state
    with pytest.raises(CopiesUnavailable) as e:
        coordinator.refresh(_pull(peers, coordinator, 3, []), ["b"])
    assert e.value.members == ("b",)
    coordinator.lost(["b"])
    history = _run(coordinator, peers, range(3, 5), lambda r: list("abcd"))
    links_gone, _, _ = history[0]
    consensus = links_gone["b"].fresh["b"]
    assert consensus is not None and "b" in links_gone["a"].fresh and "b" in links_gone["c"].fresh
    _holders_match_owners(peers, "abcd")


def test_a_leaver_is_dropped_and_a_joiner_starts_from_the_consensus_of_pulled_copies() -> None:
    peers = {m: Peer() for m in "abcde"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    present = lambda r: list("abcd") if r < 2 else list("acd") if r < 4 else list("acde")  # noqa: E731
    history = _run(coordinator, peers, range(6), present)
    links_gone, _, pulled_gone = history[2]
    assert (
        links_gone["a"].drop == ("b",) and "c" in links_gone["a"].fresh and sorted(pulled_gone) == ["a", "c"]
    )  # a, c linked
    links_join, _, pulled_join = history[4]
    assert sorted(pulled_join) == ["a", "c", "d"]  # the consensus for e
    joined = links_join["e"].fresh["e"]
    assert joined is not None
    _holders_match_owners(peers, "acde")


def test_a_tunnelled_worker_exchanges_through_the_coordinator_and_its_ring_is_the_pulling_one() -> None:
    peers = {m: Peer() for m in "abcd"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    tunnel = lambda m: "tunnel:b" if m == "b" else f"host-{m}:1"  # noqa: E731
    history = _run(coordinator, peers, range(5), lambda r: list("abcd"), address=tunnel)
    links, finish, pulled = history[-1]
    # b's neighbours a and c upload (b takes them relayed) and b does (a and c take it relayed); d pulls both.
    assert [m for m in "abcd" if links[m].upload] == ["a", "b", "c"]
    assert set(links["b"].relays) == {"a", "c"} and not links["b"].pulls
    assert set(links["a"].relays) == {"b"} and set(links["a"].pulls) == {"d"}
    assert not links["d"].relays and set(links["d"].pulls) == {"a", "c"}
    assert finish.accepted == tuple("abcd") and set(coordinator.accepted) == {"a", "b", "c"} and not pulled
    _holders_match_owners(peers, "abcd")
    _same_as_pulling_everywhere(peers, 5, present=lambda r: list("abcd"))
    assert route(graph("ring", list("abcd")), frozenset("b"), {}, 0).why[("a", "b")] == "b is a tunnelled worker"


def test_a_pull_that_failed_sends_that_pair_through_the_coordinator_until_it_is_tried_again() -> None:
    peers = {m: Peer() for m in "abcd"}
    peers["a"].blocked = {"b"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    history = _run(coordinator, peers, range(5), lambda r: list("abcd"))
    failed_at, finish, _ = history[1]  # round 0 pulls nothing: every copy goes whole
    assert set(failed_at["a"].pulls) == {"b", "d"} and "a" not in finish.accepted
    assert coordinator.failed_pulls == {("a", "b"): 1}
    then, _, pulled = history[2]  # a gets its copies whole again; b uploads from now on
    assert set(then["a"].fresh) == {"b", "d"}  # it keeps its own copy
    assert then["b"].upload and not then["a"].upload and sorted(pulled) == ["b", "d"]
    later, finish, _ = history[-1]
    assert set(later["a"].relays) == {"b"} and set(later["a"].pulls) == {"d"} and set(later["c"].pulls) == {"b", "d"}
    assert finish.accepted == tuple("abcd")
    _holders_match_owners(peers, "abcd")
    ring = graph("ring", list("abcd"))
    relayed = route(ring, frozenset(), coordinator.failed_pulls, RELAY_ROUNDS)
    assert ("a", "b") in relayed.relayed
    tried_again = route(ring, frozenset(), coordinator.failed_pulls, 1 + RELAY_ROUNDS)
    assert not tried_again.relayed
    # What the coordinator logs as routes change: each pair, and why it is relayed
    assert route_changes(tried_again, relayed) == ["a is relayed b's messages: a could not pull from b in round 1"]
    assert route_changes(relayed, tried_again) == ["a pulls b's messages again"]
    assert route_changes(relayed, relayed) == []
    coordinator.leave(list("acd"))
    assert not coordinator.failed_pulls  # b left: its pairs are forgotten


def test_a_peer_whose_messages_do_not_decode_is_checked_by_the_coordinator_and_never_added() -> None:
    """b's messages from round 1 on have a NaN scale (their digests are honest). Its neighbours fail round 2
    naming it; from then on it uploads, the coordinator refuses its messages, and nobody adds them."""
    peers = {m: Peer() for m in "abcd"}

    def nan_scale(payload):
        first, *rest = payload.tensors
        return dataclasses.replace(payload, tensors=(dataclasses.replace(first, scale=float("nan")), *rest))

    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    history = _run(coordinator, peers, range(1), lambda r: list("abcd"))
    peers["b"].corrupt = nan_scale
    history += _run(coordinator, peers, range(1, 6), lambda r: list("abcd"))
    _, pulled_bad, _ = history[2]
    assert "a" not in pulled_bad.accepted and "c" not in pulled_bad.accepted
    assert coordinator.failed_pulls == {("a", "b"): 2, ("c", "b"): 2}
    for links, finish, _ in history[3:]:
        assert links["b"].upload and "does not decode" in finish.refused["b"] and finish.accepted == ("a", "c", "d")
        assert "b" not in links["a"].relays and "b" not in links["a"].pulls
    _holders_match_owners(peers, "acd")
    for m in "ac":  # b's copy everywhere is b's own, none of its messages in it
        assert all(torch.equal(peers[m].state.node.copies["b"][k], peers["b"].state.node.own[k]) for k in SHAPES)


def test_an_uploaded_message_must_be_the_one_its_digest_names() -> None:
    peers = {m: Peer() for m in "abcd"}
    coordinator = GossipRounds("ring", 0.5, START, peer_to_peer=True)
    tunnel = lambda m: "tunnel:b" if m == "b" else f"host-{m}:1"  # noqa: E731
    _run(coordinator, peers, range(2), lambda r: list("abcd"), address=tunnel)
    links = coordinator.links(list("abcd"), {m: tunnel(m) for m in "abcd"}, _pull(peers, coordinator, 2, []), 2)
    results = {m: peers[m].round(links[m], 2, peers, 200 + i) for i, m in enumerate("abcd")}
    other = results["c"].gradient
    results["a"] = dataclasses.replace(results["a"], gradient=other)  # not what a keeps for d
    results["b"] = dataclasses.replace(results["b"], gradient=None)  # told to upload, and did not
    finish = coordinator.finish(results, CODEC)
    assert finish.accepted == ("c", "d") and set(coordinator.accepted) == {"c"}
    assert "not the one whose digest" in finish.refused["a"] and "did not" in finish.refused["b"]


def test_what_a_pull_is_refused_for() -> None:
    peer = Peer()
    links = GossipLinks("a", {"b": 0.5}, 0.5, fresh={"a": None, "b": None}, peer_key=b"k" * 32)
    peer.round(links, 3, {}, seed=0)
    state = peer.state
    assert worker_gossip.message_piece(state, b"k" * 32, 3)
    with pytest.raises(AccessDenied, match="peer key"):
        worker_gossip.message_piece(state, b"x" * 32, 3)
    with pytest.raises(NotHeld, match="round 2"):
        worker_gossip.message_piece(state, b"k" * 32, 2)
    for r in (4, 5, 6):
        worker_gossip.keep(state, r, b"piece")
    assert sorted(state.outbox) == [5, 6]  # the last two only
    # Its copy as round 4 starts: with its message of round 3 if that was accepted; not for a round it went past.
    own = state.node.own
    with_3 = worker_gossip.copy_at(state, b"k" * 32, 4, last=3)
    assert all(torch.equal(with_3[k], own[k] + state.pending[k]) for k in own)
    assert all(torch.equal(worker_gossip.copy_at(state, b"k" * 32, 4, None)[k], own[k]) for k in own)
    assert all(torch.equal(worker_gossip.copy_at(state, b"k" * 32, 4, 2)[k], own[k]) for k in own)  # an older one
    with pytest.raises(NotHeld, match="past round 2"):
        worker_gossip.copy_at(state, b"k" * 32, 2, last=None)
    with pytest.raises(AccessDenied):
        worker_gossip.copy_at(state, b"x" * 32, 4, last=None)


def test_peer_to_peer_links_and_results_round_trip_and_are_refused_when_malformed() -> None:
    digest = hashlib.sha256(b"m").digest()
    links = GossipLinks(
        "a", {"b": 0.5}, 0.5, peer_key=b"k" * 32, pulls={"b": GossipPull("b", "10.0.0.2:50051", 7, digest)}
    )
    back = gossip_from_proto(gossip_to_proto(links))
    assert back.peer_key == b"k" * 32 and back.pulls == links.pulls
    with pytest.raises(ProtocolError, match="no peer key"):
        GossipLinks("a", {"b": 0.5}, 0.5, pulls=links.pulls)
    with pytest.raises(ProtocolError, match="non-neighbours"):
        GossipLinks("a", {"c": 0.5}, 0.5, peer_key=b"k" * 32, pulls=links.pulls)
    with pytest.raises(ProtocolError, match="pulled and also"):
        GossipLinks("a", {"b": 0.5}, 0.5, fresh={"b": None}, peer_key=b"k" * 32, pulls=links.pulls)
    with pytest.raises(ProtocolError, match="32"):
        GossipPull("b", "h:1", 7, b"short")
    sent = GossipSent(digest, 1234, (1.0, -2.0), (0.5, 0.25))
    result = result_from_proto(result_to_proto(RoundResult(OK, 7, gossip_sent=sent)))
    assert result.gossip_sent == sent and result.gradient is None
    with pytest.raises(ProtocolError, match="non-finite"):
        GossipSent(digest, 1, (float("nan"),), (0.0,))
    with pytest.raises(ProtocolError, match="as long"):
        GossipSent(digest, 1, (1.0,), ())
    unreachable = RoundResult(UNREACHABLE, 7, "no route to b", unreachable_peers=("b",))
    assert result_from_proto(result_to_proto(unreachable)).unreachable_peers == ("b",)
    with pytest.raises(ProtocolError, match="unreachable"):
        result_from_proto(result_to_proto(dataclasses.replace(unreachable, unreachable_peers=())))
    with pytest.raises(ProtocolError, match="unreachable"):
        result_from_proto(result_to_proto(RoundResult(OK, 7, gossip_sent=sent, unreachable_peers=("b",))))
    assert gossip_from_proto(gossip_to_proto(dataclasses.replace(links, upload=True))).upload
    with pytest.raises(ProtocolError, match="no peer key"):
        GossipLinks("a", {"b": 0.5}, 0.5, upload=True)
    request = protocol.pb.PullGossipRequest(run_id="r", peer_key=b"", round=1)
    with pytest.raises(ProtocolError, match="peer key"):
        protocol.piece_request_from_proto(request)


def test_the_count_sketch_is_linear_the_same_everywhere_and_estimates_the_consensus_distance() -> None:
    g = torch.Generator().manual_seed(1)
    models = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in START.items()} for _ in range(6)]
    a, b = models[0], models[1]
    both = {k: a[k] + b[k] for k in a}
    torch.testing.assert_close(
        sketch.sketch(both), sketch.sketch(a) + sketch.sketch(b), atol=1e-5, rtol=0
    )  # a + b in float32
    assert torch.equal(sketch.sketch(a), sketch.sketch({k: v.clone() for k, v in a.items()}))
    estimate = sketch.consensus_distance([sketch.sketch(m) for m in models])
    assert estimate == pytest.approx(choco.consensus_distance(models), rel=0.1)
