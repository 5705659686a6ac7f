"""A worker's side of gossip rounds (``coordinator train --topology ring|exponential|complete``).

In a gossip run the worker trains a model of its own, ``x``, that persists from round to round: the
session's working model, never reloaded from the replica (which stays the run's starting state). Beside it
it keeps public copies (``gossip.node.GossipNode``): its own ``x^`` and its neighbours'. One round, in the
order worker.proto's ``GossipLinks`` gives:

  ``take_links``: forget the copies of members that are not its neighbours now, take whole copies (a new
  neighbour's; its own when it is new to the graph, when ``x`` starts from it; or all again when its copies
  are in doubt), add its own last message to ``x^`` if it was accepted, add the neighbours' relayed messages
  to their copies
  -> ``mix``: ``x <- x + gamma * sum_j W_ij (x^_j - x^)``
  -> the order's inner steps on ``x`` (``compute.inner_steps``)
  -> ``send``: the message ``q = C(x - x^)``, held until the next order says it was accepted.

Everything the order names is checked before any copy changes: a relay for a copy the worker does not hold,
or a first order that does not bring the worker's own copy, is a ``ProtocolError`` (the coordinator then
sends every copy whole in the next round), and the worker's state is as it was.

Peer-to-peer (``--peer-to-peer``) the round is the same; only the bytes travel otherwise. The engine pulls
the neighbours' messages from them (``worker.peers``) and hands them to ``take_links`` as relays, and the
worker keeps its own last messages for its neighbours to pull (``keep``, ``message_piece``) and serves its
public copy to the coordinator (``copy_at``). Those calls come on the server's threads while a round runs,
so the state's ``lock`` guards what they read; it is never held across a pull, so two neighbours pulling
from each other cannot wait on each other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Mapping

import torch

from gradwire.compression import CompressedGradient, GradientCodec
from gradwire.errors import AccessDenied, NotHeld
from gradwire.gossip import sketch
from gradwire.gossip.node import GossipNode
from gradwire.protocol import GossipLinks, GossipSent, ProtocolError, message_piece_to_bytes
from gradwire.security import same_owner

KEPT_MESSAGES = 2  # a neighbour pulls round r's message during round r + 1, when the worker may have sent r + 1's

Tensors = Mapping[str, torch.Tensor]


@dataclasses.dataclass
class GossipState:
    """A run's gossip state on this worker: the public copies, and its last message until it is accepted."""

    node: GossipNode
    pending: dict[str, torch.Tensor] | None = None  # the decoded message sent last, not yet in ``node.own``
    links_round: int = -1  # the round whose links it took last
    links_digest: bytes = b""  # and those links (``worker.rounds.links_digest``)
    sent_round: int = -1  # the round ``pending`` was sent in
    peer_key: bytes = b""  # peer-to-peer: what whoever pulls from it must present (the last order's)
    outbox: dict[int, bytes] = dataclasses.field(default_factory=dict)  # peer-to-peer: its last messages, as pulled
    start_sketch: torch.Tensor | None = None  # peer-to-peer: the sketch of the run's start, taken once
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)


class BadMessage(ProtocolError):
    """A neighbour's message that cannot be added: other codec settings, it does not decode, or non-finite."""

    def __init__(self, member: str, why: str) -> None:
        super().__init__(f"gossip: the message of {member!r} {why}")
        self.member = member


def _decoded(codec: GradientCodec, payload: CompressedGradient, member: str) -> dict[str, torch.Tensor]:
    if payload.settings != codec.config:
        raise BadMessage(member, "was compressed with other codec settings than the order's")
    try:
        q = codec.decompress(payload)
    except ValueError as e:
        raise BadMessage(member, f"does not decode: {e}") from None
    if not all(bool(torch.isfinite(t).all()) for t in q.values()):
        raise BadMessage(member, "has non-finite values")
    return q


def _checked_copy(member: str, copy: Tensors, start: Tensors) -> Tensors:
    if set(copy) != set(start):
        raise ProtocolError(f"gossip: the public copy of {member!r} must carry every tensor of the model")
    for name, t in copy.items():
        if tuple(t.shape) != tuple(start[name].shape) or not t.is_floating_point():
            raise ProtocolError(f"gossip: the public copy of {member!r}: {name} has the wrong shape or dtype")
    return copy


def take_links(
    state: GossipState | None,
    links: GossipLinks,
    model: Mapping[str, torch.Tensor],
    start: Tensors,
    codec: GradientCodec,
    keep_model: bool = False,
    round_: int = -1,
) -> GossipState:
    """Apply an order's links to ``state`` (``None``: the worker has none for the run yet, and its model
    ``x`` starts from its own public copy, which the order must bring, unless ``keep_model``: a resumed
    worker's ``x`` came with its state push). ``model``: the worker's ``x``, by tensor name (written only
    when it starts); ``start``: the run's starting state (the replica), what a copy marked ``start`` is;
    ``round_``: the order's round. Returns the state to keep."""
    fresh = {
        j: _checked_copy(j, c, start) if c is not None else start for j, c in links.fresh.items()
    }  # checked before anything changes
    relays = {j: _decoded(codec, q, j) for j, q in links.relays.items()}
    if state is None:
        if links.member not in fresh:
            raise ProtocolError(
                "gossip: this worker holds no gossip state for the run: its own public copy must come whole"
            )
        state = GossipState(GossipNode(links.member, fresh[links.member]))
        if not keep_model:
            with torch.no_grad():
                for name, t in model.items():
                    t.copy_(fresh[links.member][name])
    elif state.node.member != links.member:
        raise ProtocolError(f"gossip: this worker is {state.node.member!r} on the graph, not {links.member!r}")
    held = set(state.node.copies) - set(links.drop)
    if missing := [j for j in relays if j not in held]:
        raise ProtocolError(f"gossip: messages relayed for copies this worker does not hold: {missing}")
    if missing := [j for j in links.weights if j not in held and j not in fresh]:
        raise ProtocolError(f"gossip: no public copy of neighbours {missing} held, and none sent")
    # Copies of members that are not its neighbours now go too: the coordinator names those it knows of
    # (``drop``), but after a missed round it no longer knows what this worker holds and sends every copy
    # whole; mixing takes exactly the neighbours' copies.
    gone = {*links.drop, *(j for j in state.node.copies if j not in links.weights)}
    with state.lock:
        state.node.link({j: c for j, c in fresh.items() if j != links.member}, drop=sorted(gone))
        if links.member in fresh:  # its own copy again: what every holder has; an unaccepted message is void
            state.node.own = {k: v.detach().float().clone() for k, v in fresh[links.member].items()}
        elif (
            links.own_accepted
            and state.pending is not None
            and (not links.peer_key or state.sent_round == links.own_round)
        ):
            state.node.accept(state.pending)
        state.pending = None
        for j, q in relays.items():
            state.node.receive(j, q)
        state.links_round, state.peer_key = round_, links.peer_key
    return state


def mix(state: GossipState, links: GossipLinks, model: Mapping[str, torch.Tensor]) -> None:
    """``x <- x + gamma * sum_j W_ij (x^_j - x^)`` over the order's neighbours."""
    try:
        with torch.no_grad():
            state.node.mix(model, dict(links.weights), links.gamma)
    except ValueError as e:
        raise ProtocolError(f"gossip: {e}") from None


def send(state: GossipState, model: Tensors, codec: GradientCodec) -> tuple[CompressedGradient, float]:
    """The round's message and the residual ``|x - x^ - q|^2`` it leaves; the decoded message is held until
    the next order accepts it."""
    with torch.no_grad():
        payload, q = state.node.send(model, codec)
    with state.lock:
        state.pending, state.sent_round = q, state.links_round
    residual = float(
        sum(float((model[k].detach().float() - v - q[k]).square().sum()) for k, v in state.node.own.items())
    )
    return payload, residual


# ------------------------------------------------------------------------------- peer-to-peer


def keep(state: GossipState, round_: int, piece: bytes) -> None:
    """Keep this round's message (its serialized ``GossipPiece``) for the neighbours to pull; the oldest
    beyond ``KEPT_MESSAGES`` goes."""
    with state.lock:
        state.outbox[round_] = piece
        for old in sorted(state.outbox)[:-KEPT_MESSAGES]:
            del state.outbox[old]


def keep_for_peers(state: GossipState, round_: int, payload: CompressedGradient, start: Tensors) -> GossipSent:
    """Keep ``send``'s message of ``round_`` for the neighbours, and what the coordinator sees of it instead:
    the digest and size of what they will pull, and sketches of the message and of the public copy before it,
    less the run's start (``start``)."""
    piece = message_piece_to_bytes(state.node.member, round_, payload)
    keep(state, round_, piece)
    assert state.pending is not None, "send before keep_for_peers"
    if state.start_sketch is None:
        state.start_sketch = sketch.sketch(start)
    own = tuple((sketch.sketch(state.node.own) - state.start_sketch).tolist())  # small numbers: float32 holds them
    message = tuple(sketch.sketch(state.pending).tolist())
    return GossipSent(hashlib.sha256(piece).digest(), len(piece), own, message)


def _check_key(state: GossipState, key: bytes) -> None:
    if not state.peer_key or not same_owner(state.peer_key, key):
        raise AccessDenied("PullGossip: the peer key is not this run's")


def message_piece(state: GossipState, key: bytes, round_: int) -> bytes:
    """The message this worker sent in ``round_``, as its neighbours pull it. ``AccessDenied`` for another
    key; ``NotHeld`` for a round it no longer keeps (or never sent)."""
    with state.lock:
        _check_key(state, key)
        piece = state.outbox.get(round_)
        if piece is None:
            raise NotHeld(f"PullGossip: no message of round {round_} here (it keeps rounds {sorted(state.outbox)})")
        return piece


def copy_at(state: GossipState, key: bytes, round_: int, last: int | None) -> dict[str, torch.Tensor]:
    """This worker's public copy as it stands when it takes ``round_``'s links: with each of its messages the
    coordinator accepted, the last of them sent in round ``last`` (``None``: none). The message it holds is
    added if it is that one; a message it added already is in its copy. Served between rounds; ``NotHeld``
    for a round it has gone past."""
    with state.lock:
        _check_key(state, key)
        if state.links_round > round_:
            raise NotHeld(f"PullGossip: this worker took the links of round {state.links_round}, past round {round_}")
        if last is not None and state.pending is not None and state.sent_round == last:
            return {k: v + state.pending[k].to(v.dtype) for k, v in state.node.own.items()}
        return {k: v.clone() for k, v in state.node.own.items()}
