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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from gradwire.compression import CompressedGradient, GradientCodec
from gradwire.gossip import choco
from gradwire.gossip.topology import Graph, graph
from gradwire.protocol import GossipLinks, RoundResult


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
    and the consensus distance of the present members' public copies after it."""

    accepted: tuple[str, ...]
    refused: dict[str, str]
    consensus_distance: float


class GossipRounds:
    """A gossip run's state on the coordinator (see the module): ``links`` plans a round, ``finish`` takes
    its results."""

    def __init__(self, kind: str, gamma: float, start: Mapping[str, torch.Tensor]) -> None:
        self.kind, self.gamma = kind, gamma
        self.start = {k: v.detach().float().clone() for k, v in start.items()}
        self.copies = PublicCopies()
        self.at_start: set[str] = set()  # members whose public copy is still the run's start: sent as a flag
        self.held: dict[str, frozenset[str]] = {}  # member -> the copies it holds in step (its own among them)
        self.accepted: dict[str, CompressedGradient] = {}  # last round's accepted messages, to relay
        self.graph: Graph | None = None

    def links(self, members: Sequence[str]) -> dict[str, GossipLinks]:
        """Each member's links for this round, on the graph of ``members`` (in join order). Members new to
        the graph get a public copy: the run's start while every copy is, else the consensus."""
        for m in members:
            if m not in self.copies:
                if all(j in self.at_start for j in self.copies.members):
                    self.copies.add(m, self.start)
                    self.at_start.add(m)
                else:
                    self.copies.add(m, self.copies.consensus())
        self.graph = graph(self.kind, members)
        plans = plan_links(self.graph, {m: h - {m} for m, h in self.held.items()})
        out = {}
        for m, plan in plans.items():
            holds_own = m in self.held.get(m, frozenset())
            fresh = {j: self._whole(j) for j in plan.fresh}
            if not holds_own:
                fresh[m] = self._whole(m)
            out[m] = GossipLinks(
                m,
                plan.weights,
                self.gamma,
                own_accepted=holds_own and m in self.accepted,
                relays={j: self.accepted[j] for j in plan.relay if j in self.accepted},
                fresh=fresh,
                drop=plan.drop,
            )
        return out

    def _whole(self, member: str) -> Mapping[str, torch.Tensor] | None:
        return None if member in self.at_start else self.copies.copy_of(member)

    def finish(self, results: Mapping[str, RoundResult | None], codec: GradientCodec) -> GossipFinish:
        """Take a round's results, by member (``None``: no usable answer): each valid message moves its
        sender's public copy and is relayed next round. Returns what was accepted and the consensus
        distance after."""
        assert self.graph is not None, "links before finish"
        self.accepted, refused = {}, {}
        held: dict[str, frozenset[str]] = {}
        for m in self.graph.members:
            result = results.get(m)
            if result is None or result.gradient is None:
                refused[m] = "no answer this round: every copy goes to it whole next round"
                continue
            held[m] = frozenset(self.graph.neighbours_of(m)) | {m}  # it took this round's links
            q, why = _message(result.gradient, codec, self.start)
            if q is None:
                refused[m] = why
                continue
            self.copies.receive(m, q)
            self.at_start.discard(m)
            self.accepted[m] = result.gradient
        self.held = held
        present = [self.copies.copy_of(m) for m in self.graph.members]
        return GossipFinish(tuple(self.accepted), refused, choco.consensus_distance(present))

    def leave(self, present: Sequence[str]) -> tuple[str, ...]:
        """Forget the members no longer in the run; returns them. Their neighbours are re-linked next round."""
        gone = tuple(m for m in self.copies.members if m not in present)
        for m in gone:
            self.copies.remove(m)
            self.held.pop(m, None)
            self.accepted.pop(m, None)
            self.at_start.discard(m)
        return gone

    def consensus(self) -> dict[str, torch.Tensor]:
        """The run's model: the mean of the public copies (the start, before the first round)."""
        return self.copies.consensus() if self.copies.members else dict(self.start)

    def checkpoint(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """What a checkpoint keeps: every member's public copy (group ``gossip-copies``, keys
        ``<member>/<tensor>``), the members in join order and those still at the start."""
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


def _message(
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
