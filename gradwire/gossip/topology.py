"""The graphs gossiping workers mix over, and their mixing weights: pure functions of the members.

``graph(kind, members)`` builds an undirected graph over the present members in their given order (the
coordinator passes them in join order, so a worker that leaves re-links its neighbours and one that joins
goes to the end) and its Metropolis-Hastings weights: ``W_ij = 1 / (1 + max(d_i, d_j))`` for each edge,
``W_ii = 1 - sum_j W_ij``. ``W`` is symmetric and doubly stochastic, so mixing keeps the members' mean.

* ``ring``: each member linked to the one before and after it (degree 2; one neighbour for two members).
* ``exponential``: each member linked to those ``2^k`` places before and after it, ``2^k < n`` (degree
  about ``2 log2 n``): consensus in about ``log n`` rounds at a logarithmic degree.
* ``complete``: everyone linked to everyone: ``W = 1/n`` everywhere, one mix is exact averaging.

``star`` is not a gossip graph: it names today's centralized rounds, where the coordinator aggregates.
How fast repeated mixing reaches consensus is the spectral gap ``1 - |lambda_2(W)|``: the distance of the
members' models from their mean shrinks by at least the factor ``(1 - gap)^2`` per exact mix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

TOPOLOGIES = ("star", "ring", "exponential", "complete")
GOSSIP_TOPOLOGIES = TOPOLOGIES[1:]


def neighbour_offsets(kind: str, n: int) -> tuple[int, ...]:
    """The positive offsets ``o`` that link member ``i`` to members ``i +- o (mod n)``."""
    if kind not in GOSSIP_TOPOLOGIES:
        raise ValueError(f"a gossip topology is one of {', '.join(GOSSIP_TOPOLOGIES)}, got {kind!r}")
    if n < 1:
        raise ValueError(f"a graph needs at least one member, got {n}")
    if kind == "ring":
        return (1,) if n > 1 else ()
    if kind == "complete":
        return tuple(range(1, n // 2 + 1))
    offsets, step = [], 1
    while step < n:
        offsets.append(step)
        step *= 2
    return tuple(offsets)


@dataclasses.dataclass(frozen=True)
class Graph:
    """An undirected graph over ``members`` with its Metropolis-Hastings mixing weights."""

    kind: str
    members: tuple[str, ...]
    neighbours: tuple[tuple[int, ...], ...]  # sorted indices of each member's neighbours

    @property
    def size(self) -> int:
        return len(self.members)

    def degree(self, i: int) -> int:
        return len(self.neighbours[i])

    def weight(self, i: int, j: int) -> float:
        """``W_ij``: Metropolis-Hastings on an edge, the rest of the row on the diagonal, else 0."""
        if i == j:
            return 1.0 - sum(self.weight(i, k) for k in self.neighbours[i])
        if j in self.neighbours[i]:
            return 1.0 / (1 + max(self.degree(i), self.degree(j)))
        return 0.0

    def weights_of(self, member: str) -> dict[str, float]:
        """A member's row of ``W`` by member id: its neighbours' weights (its own is one less their sum)."""
        i = self.members.index(member)
        return {self.members[j]: self.weight(i, j) for j in self.neighbours[i]}

    def neighbours_of(self, member: str) -> tuple[str, ...]:
        return tuple(self.members[j] for j in self.neighbours[self.members.index(member)])

    def matrix(self) -> np.ndarray:
        """``W``, (n, n) float64."""
        n = self.size
        return np.array([[self.weight(i, j) for j in range(n)] for i in range(n)], dtype=np.float64)


def graph(kind: str, members: Sequence[str]) -> Graph:
    """The ``kind`` graph over ``members`` (distinct ids, in the order that places them on it)."""
    members = tuple(members)
    if len(set(members)) != len(members):
        raise ValueError("graph members must be distinct")
    n = len(members)
    offsets = neighbour_offsets(kind, n)
    links = [sorted({(i + s * o) % n for o in offsets for s in (1, -1)} - {i}) for i in range(n)]
    return Graph(kind, members, tuple(tuple(row) for row in links))


def spectral_gap(w: np.ndarray) -> float:
    """``1 - |lambda_2|`` of a symmetric mixing matrix: 1 for exact averaging, near 0 for a slow graph."""
    if w.shape[0] == 1:
        return 1.0
    magnitudes = np.sort(np.abs(np.linalg.eigvalsh(w)))[::-1]
    return float(1.0 - magnitudes[1])
