"""The coordinator's side of gossip rounds: who mixes with whom, what each worker must be sent, and the
public copies whose mean is the run's consensus model.

In gossip rounds the coordinator is membership, schedule and relay, not an aggregator. Each round it
rebuilds the graph for the present workers (``gossip.topology.graph``, in join order), and
``plan_links`` decides, for each worker, what its order carries:

* ``relay``: the neighbours whose last message (``q_j``) it must add to the public copies it holds;
* ``fresh``: the neighbours whose public copy it does not hold (new on the graph, or newly linked to it
  after someone left): it is sent whole, once;
* ``drop``: the copies it holds of members that are no longer its neighbours.

``PublicCopies`` holds every member's public copy ``x^_j``, updated with every message the coordinator
relays (it sees them all), so it can send a whole copy on re-linking and its mean is the consensus model
that evaluation, checkpoints and export show.

``GossipRounds`` is a run's memory between rounds: the copies, which copies each worker holds in step with
the coordinator's, and the messages accepted last round. What a worker holds is known only after a round it
completed: a worker that failed, was cut off or sat a round out gets every copy whole in its next round
(its own too, which voids a message it sent that never arrived), and keeps its own model. A worker new to
the graph starts from the consensus (or the run's start, before any message moved a copy).

Peer-to-peer (``peer_to_peer``) the bookkeeping is the same, but a message never reaches the coordinator:
a worker keeps it and reports its digest, and the next round's orders tell its neighbours to pull it from
the worker (``GossipLinks.pulls``). The coordinator's copy of a member goes stale with the member's first
accepted message; it pulls exact copies from their owners (``Worker.PullGossip``) only when an order must
carry one whole or the consensus must be shown, through the ``pull`` its caller gives ``links`` and
``refresh``. A worker that failed a round keeps its own copy (it drops the message the coordinator did not
accept), and one that lost its state (it had to be pushed the state again) joins anew, from the consensus.
The consensus distance comes from the count sketches the workers report (``gossip.sketch``): an estimate.

Peer-to-peer, a pair of workers that cannot reach each other falls back on the relay (``route``): a
``--tunnel`` worker serves no neighbour and pulls from none, and a worker that could not pull a neighbour's
message reports it (``RoundResult.unreachable_peers``); from then on the sender uploads its messages too
(``GossipLinks.upload``), the coordinator checks each against the digest the sender reported, and relays it
to those neighbours. The others still pull.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Callable, Mapping, Sequence

import torch

from gradwire.compression import CompressedGradient, GradientCodec
from gradwire.gossip import choco, sketch
from gradwire.gossip.topology import Graph, graph
from gradwire.protocol import GossipLinks, GossipPull, GossipSent, RoundResult, message_piece_to_bytes
from gradwire.tunnel import TUNNEL_PREFIX

Tensors = Mapping[str, torch.Tensor]
# Peer-to-peer: exact public copies of members, pulled from them as the next round starts; a member whose
# copy did not come is left out of the result (its owner is down or lost it).
Pull = Callable[[Sequence[str]], Mapping[str, Tensors]]


@dataclasses.dataclass(frozen=True)
class LinkPlan:
    """One worker's part of a gossip round (see the module)."""

    member: str
    neighbours: tuple[str, ...]
    weights: dict[str, float]  # its row of W, without its own entry
    relay: tuple[str, ...]
    fresh: tuple[str, ...]
    drop: tuple[str, ...]
    why: str


def plan_links(graph: Graph, held: Mapping[str, frozenset[str]]) -> dict[str, LinkPlan]:
    """Each member's ``LinkPlan`` on ``graph``, given the public copies each holds now (``held``; a member
    absent from it holds none: it is new)."""
    plans = {}
    for member in graph.members:
        neighbours = graph.neighbours_of(member)
        has = held.get(member, frozenset())
        fresh = tuple(j for j in neighbours if j not in has)
        relay = tuple(j for j in neighbours if j in has)
        drop = tuple(sorted(has - set(neighbours)))
        if member not in held:
            why = f"joins the {graph.kind} graph: sent {len(fresh)} public cop{'y' if len(fresh) == 1 else 'ies'}"
        elif fresh or drop:
            why = f"re-linked on the {graph.kind} graph: {len(fresh)} new neighbour(s), {len(drop)} dropped"
        else:
            why = f"same {len(neighbours)} neighbour(s) on the {graph.kind} graph: relays only"
        plans[member] = LinkPlan(member, neighbours, graph.weights_of(member), relay, fresh, drop, why)
    return plans


RELAY_ROUNDS = 100  # a pair whose pull failed is relayed for this many rounds, then tried again


@dataclasses.dataclass(frozen=True)
class Routes:
    """Peer-to-peer: how each neighbour's message reaches each member this round (see ``route``)."""

    relayed: frozenset[tuple[str, str]]  # (receiver, sender) pairs the coordinator relays for
    upload: frozenset[str]  # senders whose message some neighbour takes relayed: they upload it
    why: dict[tuple[str, str], str]


def route(graph: Graph, tunnelled: frozenset[str], failed: Mapping[tuple[str, str], int], round_: int) -> Routes:
    """Which pairs of neighbours on ``graph`` exchange through the coordinator: those where either side is a
    ``--tunnel`` worker (``tunnelled``: nobody dials it, and the addresses it would dial are the
    coordinator's view), and those whose pull failed (``failed``: (receiver, sender) -> the round it was
    reported in) fewer than ``RELAY_ROUNDS`` rounds before ``round_``. Every other pair pulls. Pure."""
    relayed, why = set(), {}
    for m in graph.members:
        for j in graph.neighbours_of(m):
            if m in tunnelled or j in tunnelled:
                relayed.add((m, j))
                why[(m, j)] = f"{m if m in tunnelled else j} is a tunnelled worker"
            elif (m, j) in failed and round_ - failed[(m, j)] < RELAY_ROUNDS:
                relayed.add((m, j))
                why[(m, j)] = f"{m} could not pull from {j} in round {failed[(m, j)]}"
    return Routes(frozenset(relayed), frozenset(j for _, j in relayed), why)


def route_changes(before: Routes, after: Routes) -> list[str]:
    """What changed from ``before`` to ``after``, a line per pair, with the reason a pair is relayed now."""
    started = [f"{m} is relayed {j}'s messages: {after.why[(m, j)]}" for m, j in sorted(after.relayed - before.relayed)]
    ended = [f"{m} pulls {j}'s messages again" for m, j in sorted(before.relayed - after.relayed)]
    return started + ended


class PublicCopies:
    """Every member's public copy ``x^_j`` (float32, on the coordinator's device), by member id."""

    def __init__(self) -> None:
        self._copies: dict[str, dict[str, torch.Tensor]] = {}

    def __contains__(self, member: str) -> bool:
        return member in self._copies

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._copies)

    def add(self, member: str, state: Mapping[str, torch.Tensor]) -> None:
        """A member's copy starts at ``state`` (what the member itself starts from)."""
        if member in self._copies:
            raise ValueError(f"{member} already has a public copy")
        self._copies[member] = {k: v.detach().float().clone() for k, v in state.items()}

    def replace(self, member: str, state: Mapping[str, torch.Tensor]) -> None:
        """A member's copy is ``state`` now (pulled from its owner), in its place among the members."""
        if member not in self._copies:
            raise ValueError(f"{member} has no public copy to replace")
        self._copies[member] = {k: v.detach().float().clone() for k, v in state.items()}

    def remove(self, member: str) -> None:
        self._copies.pop(member, None)

    def copy_of(self, member: str) -> dict[str, torch.Tensor]:
        return self._copies[member]

    def receive(self, member: str, q: Mapping[str, torch.Tensor]) -> None:
        """``x^_member += q``: the member's message of this round, as every holder adds it."""
        copy = self._copies[member]
        if set(q) != set(copy):
            raise ValueError(f"a message for {member} must carry every tensor of its copy")
        for name, t in copy.items():
            t.add_(q[name].float())

    def consensus(self) -> dict[str, torch.Tensor]:
        """The mean of the present members' public copies, summed in member order."""
        if not self._copies:
            raise ValueError("no public copies")
        copies = list(self._copies.values())
        return {name: sum(c[name] for c in copies) / len(copies) for name in copies[0]}


@dataclasses.dataclass(frozen=True)
class GossipFinish:
    """What one gossip round came to: the members whose message was accepted, why the others' were not,
    and the consensus distance of the present members' public copies after it (peer-to-peer: estimated
    from the workers' sketches)."""

    accepted: tuple[str, ...]
    refused: dict[str, str]
    consensus_distance: float


class CopiesUnavailable(Exception):
    """Peer-to-peer: public copies a round's orders need whole could not be pulled from their owners."""

    def __init__(self, members: Sequence[str]) -> None:
        super().__init__(f"the public copies of {list(members)} could not be pulled from their owners")
        self.members = tuple(members)


class GossipRounds:
    """A gossip run's state on the coordinator (see the module): ``links`` plans a round, ``finish`` takes
    its results."""

    def __init__(self, kind: str, gamma: float, start: Mapping[str, torch.Tensor], peer_to_peer: bool = False) -> None:
        self.kind, self.gamma = kind, gamma
        self.start = {k: v.detach().float().clone() for k, v in start.items()}
        self.copies = PublicCopies()
        self.at_start: set[str] = set()  # members whose public copy is still the run's start: sent as a flag
        self.held: dict[str, frozenset[str]] = {}  # member -> the copies it holds in step (its own among them)
        self.accepted: dict[str, CompressedGradient] = {}  # last round's accepted messages, to relay
        self.graph: Graph | None = None
        self.held_before: set[str] = set()  # members that took links in some round (peer-to-peer: keep their own)
        # Peer-to-peer: what every pull presents, the accepted messages' digests (and the round they were
        # sent in), whose copies here are stale, and each member's sketch of its copy less the start.
        self.peer_key = secrets.token_bytes(32) if peer_to_peer else b""
        self.sent: dict[str, tuple[int, GossipSent]] = {}  # last round's accepted messages, to pull
        self.last_accepted: dict[str, int] = {}  # the round each member's latest accepted message was sent in
        self.stale: set[str] = set()
        self.sketches: dict[str, torch.Tensor] = {}
        self._start_sketch: torch.Tensor | None = None
        # Peer-to-peer relay fallback: (receiver, sender) pairs whose pull failed, and the round it was reported.
        self.failed_pulls: dict[tuple[str, str], int] = {}
        self.routes = Routes(frozenset(), frozenset(), {})

    @property
    def peer_to_peer(self) -> bool:
        return bool(self.peer_key)

    def links(
        self,
        members: Sequence[str],
        addresses: Mapping[str, str] | None = None,
        pull: Pull | None = None,
        round_: int = 0,
    ) -> dict[str, GossipLinks]:
        """Each member's links for this round (``round_``), on the graph of ``members`` (in join order). Members
        new to the graph get a public copy: the run's start while every copy is, else the consensus.
        Peer-to-peer, ``addresses`` says where each member's neighbours reach it, and ``pull`` brings the
        exact copies the orders must carry whole; ``CopiesUnavailable`` names the members whose copies did
        not come (nothing changed: the caller leaves them out and asks again)."""
        linked = graph(self.kind, members)
        if self.peer_to_peer:
            assert addresses is not None and pull is not None, "peer-to-peer links need addresses and a pull"
            tunnelled = frozenset(m for m in members if addresses[m].startswith(TUNNEL_PREFIX))
            self.routes = route(linked, tunnelled, self.failed_pulls, round_)
            self._pull_needed(linked, pull)
        self.admit(members)
        self.graph = linked
        plans = plan_links(self.graph, self._holding())
        relayed = self.routes.relayed
        out = {}
        for m, plan in plans.items():
            holds_own = m in self.held.get(m, frozenset())
            fresh = {j: self._whole(j) for j in plan.fresh}
            if not holds_own and not self._keeps_own(m):
                fresh[m] = self._whole(m)
            relays = {
                j: self.accepted[j]
                for j in plan.relay
                if j in self.accepted and (not self.peer_to_peer or (m, j) in relayed)
            }
            pulls = {
                j: GossipPull(j, addresses[j], self.sent[j][0], self.sent[j][1].digest)  # type: ignore[index]
                for j in plan.relay
                if j in self.sent and (m, j) not in relayed
            }
            out[m] = GossipLinks(
                m,
                plan.weights,
                self.gamma,
                own_accepted=(holds_own and m in self.accepted) or (self._keeps_own(m) and m in self.last_accepted),
                relays=relays,
                fresh=fresh,
                drop=plan.drop,
                peer_key=self.peer_key,
                pulls=pulls,
                own_round=self.last_accepted.get(m, 0),
                upload=m in self.routes.upload,
            )
        return out

    def admit(self, members: Sequence[str]) -> None:
        """Give each of ``members`` new to the graph its public copy, in order: the run's start while every
        copy is, else the consensus."""
        for m in members:
            if m not in self.copies:
                if all(j in self.at_start for j in self.copies.members):
                    self.copies.add(m, self.start)
                    self.at_start.add(m)
                else:
                    self.copies.add(m, self.copies.consensus())

    def _holding(self) -> dict[str, frozenset[str]]:
        """The neighbours' copies each member holds in step, as ``plan_links`` takes them. Peer-to-peer, a copy
        whose accepted message the member can neither pull nor be relayed (the pair went over to the relay
        after the sender sent it) is not: it goes whole."""
        out = {}
        for m, h in self.held.items():
            cut = {j for j in h if (m, j) in self.routes.relayed and j in self.sent and j not in self.accepted}
            out[m] = h - {m} - cut
        return out

    def unreachable(self, receiver: str, senders: Sequence[str], round_: int) -> None:
        """Peer-to-peer: ``receiver`` could not pull the messages of ``senders`` in ``round_``: relay them."""
        for j in senders:
            self.failed_pulls[(receiver, j)] = round_

    def _keeps_own(self, member: str) -> bool:
        """Peer-to-peer, a member known to the graph keeps its own public copy when it failed a round: it is
        the authority on it (it drops a message that was not accepted), and the coordinator's may be stale."""
        return self.peer_to_peer and member in self.held_before

    def _whole(self, member: str) -> Mapping[str, torch.Tensor] | None:
        assert member not in self.stale, f"the public copy of {member} is stale here: pull it first"
        return None if member in self.at_start else self.copies.copy_of(member)

    def _pull_needed(self, linked: Graph, pull: Pull) -> None:
        """Peer-to-peer: make exact here every copy this round's orders on ``linked`` carry whole, and every
        copy the consensus is taken of when someone joins; ``CopiesUnavailable`` if some did not come."""
        known = [m for m in linked.members if m in self.copies]
        needed: set[str] = set()
        if len(known) < len(linked.members) and not all(j in self.at_start for j in self.copies.members):
            needed |= set(known)  # a joiner starts from the consensus
        plans = plan_links(linked, self._holding())
        for plan in plans.values():
            needed |= {j for j in plan.fresh if j in self.copies}
        self.refresh(pull, sorted(needed & self.stale))

    def refresh(self, pull: Pull, members: Sequence[str] | None = None) -> None:
        """Peer-to-peer: pull the exact copies of ``members`` (default: every stale one) from their owners;
        ``CopiesUnavailable`` naming those that did not come (the others are refreshed)."""
        wanted = sorted(self.stale if members is None else members)
        if not wanted:
            return
        got = pull(wanted)
        for m, copy in got.items():
            if m in self.stale:
                self.copies.replace(m, copy)
                self.stale.discard(m)
                self.sketches[m] = self.sketch_of(copy)
        if missing := [m for m in wanted if m not in got]:
            raise CopiesUnavailable(missing)

    def last(self, member: str) -> int | None:
        """Peer-to-peer: the round ``member``'s latest accepted message was sent in (``None``: none yet), which
        the copy pulled from it must hold."""
        return self.last_accepted.get(member)

    def sketch_of(self, copy: Tensors) -> torch.Tensor:
        """The count sketch of a public copy's drift from the run's start: what a member's sketch holds."""
        return sketch.sketch(copy) - self._start()

    def finish(self, results: Mapping[str, RoundResult | None], codec: GradientCodec) -> GossipFinish:
        """Take a round's results, by member (``None``: no usable answer): each valid message moves its
        sender's public copy and is relayed next round. Returns what was accepted and the consensus
        distance after."""
        assert self.graph is not None, "links before finish"
        if self.peer_to_peer:
            return self._finish_peer_to_peer(results, codec)
        self.accepted, refused = {}, {}
        held: dict[str, frozenset[str]] = {}
        for m in self.graph.members:
            result = results.get(m)
            if result is None or result.gradient is None:
                refused[m] = "no answer this round: every copy goes to it whole next round"
                continue
            held[m] = frozenset(self.graph.neighbours_of(m)) | {m}  # it took this round's links
            q, why = decode_message(result.gradient, codec, self.start)
            if q is None:
                refused[m] = why
                continue
            self.copies.receive(m, q)
            self.at_start.discard(m)
            self.accepted[m] = result.gradient
        self.held_before, self.held = self.held_before | set(held), held
        present = [self.copies.copy_of(m) for m in self.graph.members]
        return GossipFinish(tuple(self.accepted), refused, choco.consensus_distance(present))

    def _finish_peer_to_peer(self, results: Mapping[str, RoundResult | None], codec: GradientCodec) -> GossipFinish:
        """A peer-to-peer round's results: a message is accepted on its digest (its neighbours check what
        they pull against it, and its content as they decode it; an uploaded one is checked here, against
        both); its sender's copy here goes stale, and its sender's sketch moves by the message's."""
        assert self.graph is not None
        self.sent, self.accepted, refused = {}, {}, {}
        held: dict[str, frozenset[str]] = {}
        size = len(self._start())
        for m in self.graph.members:
            result = results.get(m)
            sent = result.gossip_sent if result is not None else None
            if sent is None:
                refused[m] = "no answer this round: it keeps its own copy, and every other goes to it whole next round"
                continue
            held[m] = frozenset(self.graph.neighbours_of(m)) | {m}
            if len(sent.sketch) != size:
                refused[m] = f"its sketches hold {len(sent.sketch)} numbers, not {size}"
                continue
            assert result is not None
            if m in self.routes.upload or result.gradient is not None:
                why = _uploaded(m, result, sent, codec, self.start)
                if why:
                    refused[m] = why
                    continue
                self.accepted[m] = result.gradient  # type: ignore[assignment]
            self.sent[m] = (result.round, sent)
            self.last_accepted[m] = result.round
            self.sketches[m] = torch.tensor(sent.sketch, dtype=torch.float64) + torch.tensor(
                sent.message_sketch, dtype=torch.float64
            )
            self.at_start.discard(m)
            self.stale.add(m)
        self.held_before, self.held = self.held_before | set(held), held
        for m in self.graph.members:  # a copy no message moved yet: its sketch is exact here
            if m not in self.sketches:
                self.sketches[m] = self.sketch_of(self.copies.copy_of(m))
        distance = sketch.consensus_distance([self.sketches[m] for m in self.graph.members])
        return GossipFinish(tuple(self.sent), refused, distance)

    def _start(self) -> torch.Tensor:
        """The sketch of the run's start, taken once."""
        if self._start_sketch is None:
            self._start_sketch = sketch.sketch(self.start)
        return self._start_sketch

    def lost(self, members: Sequence[str]) -> None:
        """Peer-to-peer: members whose worker lost its gossip state (it was pushed the state again). Nobody
        holds their copy any more: each joins anew next round, from the consensus, and its holders are sent
        its new copy whole."""
        for m in members:
            self.copies.remove(m)
            self.held.pop(m, None)
            self.sent.pop(m, None)
            self.last_accepted.pop(m, None)
            self.sketches.pop(m, None)
            self.stale.discard(m)
            self.at_start.discard(m)
            self.held_before.discard(m)
        self._forget_pulls(members)
        self.held = {h: frozenset(c - set(members)) for h, c in self.held.items()}

    def _forget_pulls(self, members: Sequence[str]) -> None:
        self.failed_pulls = {p: r for p, r in self.failed_pulls.items() if not set(p) & set(members)}

    def leave(self, present: Sequence[str]) -> tuple[str, ...]:
        """Forget the members no longer in the run; returns them. Their neighbours are re-linked next round."""
        gone = tuple(m for m in self.copies.members if m not in present)
        for m in gone:
            self.copies.remove(m)
            self.held.pop(m, None)
            self.accepted.pop(m, None)
            self.at_start.discard(m)
            self.sent.pop(m, None)
            self.last_accepted.pop(m, None)
            self.sketches.pop(m, None)
            self.stale.discard(m)
            self.held_before.discard(m)
        self._forget_pulls(gone)
        return gone

    def consensus(self) -> dict[str, torch.Tensor]:
        """The run's model: the mean of the public copies (the start, before the first round). Peer-to-peer,
        ``refresh`` first: a stale copy is the member's as the coordinator last knew it."""
        return self.copies.consensus() if self.copies.members else dict(self.start)

    def checkpoint(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """What a checkpoint keeps: every member's public copy (group ``gossip-copies``, keys
        ``<member>/<tensor>``), the members in join order and those still at the start. Peer-to-peer,
        ``refresh`` first (a resumed run sends every copy whole from these)."""
        copies = {f"{m}/{k}": v for m in self.copies.members for k, v in self.copies.copy_of(m).items()}
        meta = {"members": list(self.copies.members), "at_start": sorted(self.at_start)}
        return {"gossip-copies": copies}, {"gossip": meta}

    def restore(self, groups: Mapping[str, Mapping[str, torch.Tensor]], meta: Mapping) -> None:
        """Take back what ``checkpoint`` kept. The workers come back fresh: none holds a copy in step, so the
        next round sends each one every copy whole (the last round's messages are in them), its own too."""
        saved, tensors = meta["gossip"], groups["gossip-copies"]
        copies = PublicCopies()
        for m in saved["members"]:
            state = {k: tensors[f"{m}/{k}"] for k in self.start}
            if any(tuple(state[k].shape) != tuple(v.shape) for k, v in self.start.items()):
                raise ValueError(f"checkpoint: the public copy of {m} does not fit the model")
            copies.add(m, state)
        self.copies, self.at_start = copies, set(saved["at_start"]) & set(saved["members"])
        self.held, self.accepted, self.graph = {}, {}, None
        self.sent, self.last_accepted, self.stale, self.sketches, self.held_before = {}, {}, set(), {}, set()
        self.failed_pulls, self.routes = {}, Routes(frozenset(), frozenset(), {})


def check_copy(copy: Tensors, start: Tensors) -> None:
    """A public copy pulled from its owner: every tensor of the model, in its shape, finite; ``ValueError``."""
    if set(copy) != set(start):
        raise ValueError("a public copy must carry every tensor of the model, and no other")
    for name, t in copy.items():
        if tuple(t.shape) != tuple(start[name].shape) or not t.is_floating_point():
            raise ValueError(f"a public copy's {name} has the wrong shape or dtype")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"a public copy's {name} has non-finite values")


def _uploaded(member: str, result: RoundResult, sent: GossipSent, codec: GradientCodec, start: Tensors) -> str:
    """Why a peer-to-peer message the coordinator must relay cannot be (``""``: it can): it did not come, it
    is not the message whose digest its sender reported (the one its other neighbours pull), or it does not
    decode to the model's tensors, finite."""
    if result.gradient is None:
        return "it was to upload its message for neighbours that cannot pull from it, and did not"
    piece = message_piece_to_bytes(member, result.round, result.gradient)
    if len(piece) != sent.nbytes or hashlib.sha256(piece).digest() != sent.digest:
        return "the message it uploaded is not the one whose digest it reported"
    return decode_message(result.gradient, codec, start)[1]


def decode_message(
    payload: CompressedGradient, codec: GradientCodec, start: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor] | None, str]:
    """A gossip message decoded as every holder decodes it (and ""), or ``None`` and why it cannot be used."""
    if payload.settings != codec.config:
        return None, "its message was compressed with other codec settings than the run's"
    try:
        q = codec.decompress(payload)
    except ValueError as e:
        return None, f"its message does not decode: {e}"
    if set(q) != set(start) or any(tuple(q[k].shape) != tuple(v.shape) for k, v in start.items()):
        return None, "its message does not carry the model's tensors"
    if not all(bool(torch.isfinite(t).all()) for t in q.values()):
        return None, "its message has non-finite values"
    return q, ""
