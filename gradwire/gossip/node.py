"""What one gossiping node keeps between rounds: its public copy ``x^_i``, the public copies of its
neighbours, and how it sends, receives and mixes (``choco`` on named tensors, the codec on the wire).

CHOCO's difference ``x_i - x^_i`` is its own error feedback: what a message leaves unsent stays in it and
goes out in later rounds, so ``send`` compresses it without an error-feedback buffer (one would send the
same remainder twice). A message's effect is the codec's decoding of it (``GradientCodec.decompress``),
the same bits at the sender, the coordinator and every neighbour, so every holder's copy of ``x^_i`` stays
identical; a node adds its own message to ``x^_i`` only once it is accepted (``accept``). The state crosses
the network and goes into checkpoints as named tensors: ``own/<tensor>`` and ``copy/<member>/<tensor>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from gradwire.compression.codec import GradientCodec
from gradwire.compression.payload import CompressedGradient
from gradwire.gossip import choco

Tensors = Mapping[str, torch.Tensor]


def _copy(state: Tensors) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in state.items()}


class GossipNode:
    """One node's public copies (float32). ``own`` starts at the node's starting model."""

    def __init__(self, member: str, start: Tensors) -> None:
        self.member = member
        self.own = _copy(start)
        self.copies: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def neighbours(self) -> tuple[str, ...]:
        return tuple(sorted(self.copies))

    def link(self, fresh: Mapping[str, Tensors], drop: Iterable[str] = ()) -> None:
        """Take whole public copies of new neighbours and forget those of members no longer linked."""
        for member in drop:
            self.copies.pop(member, None)
        for member, state in fresh.items():
            if member == self.member:
                raise ValueError("a node's own public copy is not a neighbour's")
            if set(state) != set(self.own):
                raise ValueError(f"public copy of {member}: it must carry every tensor of the model")
            self.copies[member] = _copy(state)

    def receive(self, member: str, q: Tensors) -> None:
        """A neighbour's decoded message of the last round: ``x^_member += q``."""
        if member not in self.copies:
            raise ValueError(f"{member} is not a neighbour of {self.member}: no public copy to update")
        choco.receive(self.copies[member], q)

    def mix(self, model: Mapping[str, torch.Tensor], weights: Mapping[str, float], gamma: float) -> None:
        """``x_i <- x_i + gamma * sum_j W_ij (x^_j - x^_i)`` over every neighbour held."""
        choco.mix(model, self.own, self.copies, weights, gamma)

    def send(self, model: Tensors, codec: GradientCodec) -> tuple[CompressedGradient, dict[str, torch.Tensor]]:
        """This round's message ``q_i = C(x_i - x^_i)`` and its decoding. ``x^_i`` moves only by ``accept``:
        once the message is known to have reached every holder of ``x^_i`` (the next order says so)."""
        payload = codec.compress(choco.difference(model, self.own))
        return payload, codec.decompress(payload)

    def accept(self, q: Tensors) -> None:
        """Its own message reached every holder: ``x^_i += q``, as they all add it."""
        choco.receive(self.own, q)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"own/{k}": v.clone() for k, v in self.own.items()}
        for member, copy in sorted(self.copies.items()):
            out.update({f"copy/{member}/{k}": v.clone() for k, v in copy.items()})
        return out

    def load_state_tensors(self, state: Tensors) -> None:
        """Replace every copy with ``state`` (as ``state_tensors`` returns it), checked before anything changes."""
        own: dict[str, torch.Tensor] = {}
        copies: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            kind, _, rest = key.partition("/")
            if kind == "own":
                own[rest] = value
            elif kind == "copy" and "/" in rest:
                member, _, name = rest.partition("/")
                copies.setdefault(member, {})[name] = value
            else:
                raise ValueError(f"gossip state key {key!r} is neither own/<tensor> nor copy/<member>/<tensor>")
        for label, tensors in [("own", own), *((f"copy of {m}", c) for m, c in copies.items())]:
            if set(tensors) != set(self.own):
                raise ValueError(f"gossip state: the {label} must carry every tensor of the model")
            for name, t in tensors.items():
                if t.shape != self.own[name].shape or not bool(torch.isfinite(t).all()):
                    raise ValueError(f"gossip state: {label}/{name} has the wrong shape or non-finite values")
        self.own = _copy(own)
        self.copies = {m: _copy(c) for m, c in copies.items()}
