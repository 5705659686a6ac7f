"""A gossip round's stages on a worker (``worker.gossip`` holds the state they move). No networking here
beyond the neighbours' pulls (``worker.peers``), which rank 0 makes and hands to the node's other ranks.

  links     take the order's links; peer-to-peer, the neighbours' messages pulled from them first
  mix       x <- x + gamma * sum_j W_ij (x^_j - x^)
  compute   the order's inner steps on the worker's own model
  send      the message C(x - x^); peer-to-peer, kept for the neighbours to pull

The replica does not move: it stays the run's starting state. Once its links are taken a round runs to its
end, even if its call is cancelled, and its result is kept (``Done``): a coordinator restarted from its
update log asks for the round in flight again and gets that result, not a second round on moved state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

from gradwire import protocol
from gradwire.errors import AccessDenied, PeersUnreachable
from gradwire.protocol import OK, UNREACHABLE, GossipLinks, GossipPieceRequest, ProtocolError, RoundResult, WorkOrder
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker import gossip
from gradwire.worker.compute import inner_steps
from gradwire.worker.node import NodeGroup
from gradwire.worker.peers import Peers
from gradwire.worker.rounds import Done, Marks, NodeErrors, Rounds, links_digest, timings
from gradwire.worker.session import Session

_PULLED, _UNREACHABLE = b"L", b"U"  # what rank 0 of a node hands its ranks after a peer-to-peer pull


def run(
    rounds: Rounds, peers: Peers, session: Session, order: WorkOrder, cancelled: Callable[[], bool], t0: float
) -> RoundResult:
    """A gossip round: take the order's links, mix, train the worker's own model in place, and send its
    message.

    On a node whose ranks each hold the whole model (ddp, local-sgd, fsdp:optimizer) every rank keeps the same
    gossip state: each takes the same links and mixes alike, the inner steps end with the same model on
    every rank (DDP's gradient all-reduce, local-sgd's parameter average), and each sends the same
    message; rank 0 answers for the node. Only rank 0 pulls from neighbours (``pull_neighbours``)."""
    if session.placement.split:
        raise ProtocolError(
            f"gossip rounds need every rank to hold the whole model; this node splits it ({session.placement.mode})"
        )
    links, replica, node = order.gossip, session.replica, rounds.node
    assert links is not None
    if (again := rounds.again(session, order)) is not None:  # a restarted coordinator asks for it again
        return again
    digest = links_digest(order)
    taken = session.gossip
    if taken is not None and (taken.links_round, taken.links_digest) == (order.round, digest):
        raise ProtocolError(
            f"gossip: round {order.round}'s links were taken here already and the round did not finish: "
            "taking them twice would add its messages twice"
        )
    codec = replica.codec(order.codec)
    working = session.own_model()
    model = dict(zip(replica.params, working.parameters()))
    keep = session.gossip is None and session.own_model_restored  # a resumed run's x came with the push
    if links.pulls:  # peer-to-peer: the neighbours' messages come from them, then go in as relays would
        pulled = pull_neighbours(node, peers, order, links, replica.version, cancelled)
        if isinstance(pulled, RoundResult):  # nothing taken: the coordinator relays them from now on
            return pulled
        links = pulled
    try:
        session.gossip = gossip.take_links(
            session.gossip, links, model, replica.params, codec, keep_model=keep, round_=order.round
        )
    except gossip.BadMessage as e:  # nothing taken; one pulled: the coordinator checks that sender's from now on
        if e.member not in order.gossip.pulls:
            raise
        return RoundResult(UNREACHABLE, order.round, str(e), version=replica.version, unreachable_peers=(e.member,))
    session.gossip.links_digest = digest
    # From here the round runs to its end, cancelled or not: the copies and the worker's own model have moved,
    # and only the whole round leaves them where a coordinator can name them (by the round, whose result a
    # restarted coordinator gets again).
    gossip.mix(session.gossip, links, model)
    t_compute = time.perf_counter()
    tokens = rounds.tokens(order.batch)
    trained = inner_steps(session, working, order, tokens, _never, session.placement)
    t_encode = time.perf_counter()
    payload, residual = gossip.send(session.gossip, model, codec)
    if node is not None and not node.info.leader:  # rank 0 answers for the node
        result = RoundResult(OK, order.round, "", None, trained.loss, 0, replica.version)
        session.last_done = Done(dataclasses.replace(order, gossip=None), replica.version, result, digest)
        return result
    sent = None
    if links.peer_key:  # kept for the neighbours to pull; the coordinator gets its digest and sketches
        sent = gossip.keep_for_peers(session.gossip, order.round, payload, replica.params)
        payload = payload if links.upload else None  # uploaded for neighbours that cannot pull from it
    marks = Marks(t0, t_compute, t_encode, t_encode, time.perf_counter())
    result = RoundResult(
        OK,
        order.round,
        "",
        payload,
        trained.loss,
        tokens.shape[0] * (tokens.shape[1] - 1),
        replica.version,
        timings(session, marks, t_encode - t_compute),
        grad_norm=trained.grad_norm,
        gradient_fingerprint=trained.fingerprint,
        gossip_residual=residual,
        gossip_sent=sent,
    )
    session.last_done = Done(dataclasses.replace(order, gossip=None), replica.version, result, digest)
    return result


def _never() -> bool:
    return False


def pull_neighbours(
    node: NodeGroup | None,
    peers: Peers,
    order: WorkOrder,
    links: GossipLinks,
    version: int,
    cancelled: Callable[[], bool],
) -> GossipLinks | RoundResult:
    """Peer-to-peer: the links with the messages they name pulled and put among the relays, or the round's
    answer if a neighbour could not be reached. On a node rank 0 pulls and hands the other ranks either
    one as protobuf bytes (a tag, then the message), so that all of them go on alike."""
    if node is not None and not node.info.leader:
        data = node.broadcast_bytes()
        if data[:1] == _PULLED:
            return protocol.gossip_from_proto(protocol.parse(pb.GossipLinks, data[1:]))
        if data[:1] == _UNREACHABLE:
            return protocol.result_from_proto(protocol.parse(pb.RoundResult, data[1:]))
        raise ProtocolError(f"round {order.round}: rank 0 gave the round up while it pulled the neighbours'")
    outcome: GossipLinks | RoundResult
    try:
        pulled = peers.pull(order.run_id, links.peer_key, links.pulls, cancelled)
        outcome = dataclasses.replace(links, relays={**links.relays, **pulled}, pulls={})
    except PeersUnreachable as e:
        outcome = RoundResult(UNREACHABLE, order.round, str(e), version=version, unreachable_peers=e.members)
    except BaseException:
        if node is not None:
            with NodeErrors():
                node.broadcast_bytes(b"-")  # the other ranks give the round up too
        raise
    if node is not None:
        if isinstance(outcome, RoundResult):
            data = _UNREACHABLE + protocol.result_to_proto(outcome).SerializeToString()
        else:
            data = _PULLED + protocol.gossip_to_proto(outcome).SerializeToString()
        with NodeErrors():
            node.broadcast_bytes(data)
    return outcome


def piece(sessions: Mapping[str, Session], request: GossipPieceRequest) -> bytes:
    """What ``Worker.PullGossip`` answers: this worker's message of a round, or its public copy, as the
    serialized ``GossipPiece``. Authorised by the run's peer key, not by ownership: neighbours ask too."""
    session = sessions.get(request.run_id)
    state = session.gossip if session is not None else None
    if state is None:
        raise AccessDenied(f"PullGossip: no peer-to-peer gossip of run {request.run_id!r} here")
    if not request.copy:
        return gossip.message_piece(state, request.peer_key, request.round)
    copy = gossip.copy_at(state, request.peer_key, request.round, request.last)
    return protocol.copy_piece_to_proto(state.node.member, request.round, copy).SerializeToString()
