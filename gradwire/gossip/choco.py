"""CHOCO-style compressed gossip: the step every node takes with its neighbours, on named tensors.

Every node ``i`` keeps its model ``x_i`` and public copies ``x^_j`` of itself and each neighbour, the same
bits at every holder. A round:

1. node ``i`` sends ``q_i = C(x_i - x^_i)`` (the codec with error feedback; exact gossip: ``C`` = identity);
2. every holder of ``x^_i`` adds it: ``x^_i <- x^_i + q_i`` (``receive``);
3. node ``i`` mixes: ``x_i <- x_i + gamma * sum_j W_ij (x^_j - x^_i)`` (``mix``).

With ``W`` symmetric and doubly stochastic the mixing keeps the mean of the ``x_i`` exactly (a pair's
terms cancel). With ``C`` exact and ``gamma = 1`` the public copies are the models, and one mix on the
complete graph is model averaging.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]


def difference(model: Tensors, public: Tensors) -> dict[str, torch.Tensor]:
    """``x_i - x^_i``: what node ``i`` compresses and sends this round, float32."""
    return {name: model[name].detach().float() - public[name].float() for name in public}


def receive(public: Mapping[str, torch.Tensor], q: Tensors) -> None:
    """``x^ <- x^ + q`` in place: what every holder of a public copy does with its owner's message."""
    for name, t in public.items():
        t.add_(q[name].to(t.dtype))


def mix(
    model: Mapping[str, torch.Tensor],
    own_public: Tensors,
    neighbours: Mapping[str, Tensors],
    weights: Mapping[str, float],
    gamma: float,
) -> None:
    """``x_i <- x_i + gamma * sum_j W_ij (x^_j - x^_i)`` in place, over the neighbours' public copies by
    id; ``weights`` is the node's row of ``W`` without its own entry (``topology.Graph.weights_of``)."""
    if set(neighbours) != set(weights):
        raise ValueError(f"public copies of {sorted(neighbours)} but weights for {sorted(weights)}")
    if not 0 < gamma <= 1:
        raise ValueError(f"the gossip step gamma must be in (0, 1], got {gamma}")
    for name, x in model.items():
        pull = torch.zeros_like(x, dtype=torch.float32)
        mine = own_public[name].float()
        for peer in sorted(neighbours):  # a fixed order: every replay of this mix rounds alike
            pull.add_(neighbours[peer][name].float() - mine, alpha=weights[peer])
        x.add_((gamma * pull).to(x.dtype))


def consensus_distance(models: Sequence[Tensors]) -> float:
    """The mean over nodes of ``||x_i - mean_j x_j||^2``, summed over tensors (float64)."""
    if not models:
        raise ValueError("no models")
    total = 0.0
    for name in models[0]:
        stack = torch.stack([m[name].detach().double() for m in models])
        total += float(((stack - stack.mean(dim=0)) ** 2).sum()) / len(models)
    return total
