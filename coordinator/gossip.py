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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from gradwire.gossip.topology import Graph


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
