"""Relayed star rounds' pure parts: an update that names payloads instead of carrying them round-trips and
is put back whole; the wire form is validated before anything is pulled; a worker serves what it holds only
with the run's peer key; the coordinator's choice of sources says why it names none."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, CompressedGradient, GradientCodec
from gradwire.coordinator.relay import QUIET_ROUNDS, Held, Relay, fanout_tree, held_piece, sources
from gradwire.errors import AccessDenied, NotHeld
from gradwire.protocol import PieceRequest, ProtocolError, WorkOrder
from gradwire.relay import Held as HeldPieces
from gradwire.relay import PieceRef, digest_of, payload_bytes
from gradwire.replica import Fingerprint, StateUpdate
from gradwire.tunnel import TUNNEL_PREFIX
from gradwire.v1 import worker_pb2 as pb

SHAPES = {"w": (32, 32), "b": (8,)}


def _payloads(n: int) -> list[CompressedGradient]:
    codec = GradientCodec(SHAPES, CodecConfig(chunk=16, topk=4))
    gen = torch.Generator().manual_seed(0)
    return [codec.compress({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}) for _ in range(n)]


def _ref(position: int, payload: CompressedGradient, *sources: str) -> PieceRef:
    data = payload_bytes(payload)
    return PieceRef(position, digest_of(data), len(data), sources or ("10.0.0.1:50051",))


def test_an_update_names_payloads_and_is_put_back_whole_around_the_receivers_own():
    payloads = _payloads(4)
    whole = StateUpdate(0.5, tuple(payloads), (1.0, 2.0, 3.0, 4.0), scales=(1.0, 0.5, 1.0, 1.0))
    mine = whole.without(1, round=7)  # the receiver sent payload 1
    relayed = mine.relaying([_ref(3, payloads[3]), _ref(0, payloads[0])])
    assert relayed.payloads == (payloads[2],) and [r.position for r in relayed.relayed] == [0, 3]
    assert relayed.senders == 4 and relayed.nbytes == payloads[2].nbytes
    back = relayed.with_pulled({0: payloads[0], 3: payloads[3]}).with_own(payloads[1])
    assert back == whole
    # Over the wire and back: the same update, names and all.
    assert protocol.update_from_proto(protocol.update_to_proto(relayed)) == relayed
    with pytest.raises(ValueError, match="not senders"):
        mine.relaying([_ref(1, payloads[1])])  # the receiver's own is never relayed
    with pytest.raises(ValueError, match="pulled payloads"):
        relayed.with_pulled({0: payloads[0]})  # every relayed payload, or none
    with pytest.raises(ValueError, match="relayed payloads back first"):
        relayed.with_own(payloads[1])


def _wire(update: StateUpdate, **ref_changes: object) -> pb.StateUpdate:
    m = protocol.update_to_proto(update)
    for key, value in ref_changes.items():
        if key == "extra":
            m.replay.relayed.add().CopyFrom(m.replay.relayed[0])
        elif key == "sources":
            del m.replay.relayed[0].sources[:]
            m.replay.relayed[0].sources.extend(value)  # type: ignore[arg-type]
        else:
            setattr(m.replay.relayed[0], key, value)
    return m


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"position": 5}, "not another sender"),
        ({"position": 1}, "not another sender"),  # the receiver's own
        ({"digest": b"short"}, "digest is 32 bytes"),
        ({"size": 0}, "size > 0"),
        ({"size": protocol.MAX_PIECE_BYTES + 1}, "over"),
        ({"sources": []}, "1-16 sources"),
        ({"sources": ["a:1"] * 17}, "1-16 sources"),
        ({"sources": ["bad\naddress"]}, "printable"),
        ({"extra": True}, "weights"),  # one sender more than it has weights for
    ],
)
def test_a_relayed_update_off_the_wire_is_refused_before_anything_is_pulled(changes, message):
    payloads = _payloads(3)
    update = StateUpdate(0.5, tuple(payloads), (1.0, 1.0, 1.0)).without(1, round=2).relaying([_ref(0, payloads[0])])
    with pytest.raises(ProtocolError, match=message):
        protocol.update_from_proto(_wire(update, **changes))


def test_an_order_that_relays_payloads_carries_a_peer_key():
    payloads = _payloads(2)
    update = StateUpdate(0.5, tuple(payloads), (1.0, 1.0)).without(1, round=2).relaying([_ref(0, payloads[0])])
    order = WorkOrder("run", 3, 2, np.zeros((1, 9), np.uint16), CodecConfig(), Fingerprint((), (), ()), update)
    with pytest.raises(ProtocolError, match="no peer key"):
        protocol.order_from_proto(protocol.order_to_proto(order))
    keyed = dataclasses.replace(order, peer_key=b"k" * 32)
    assert protocol.order_from_proto(protocol.order_to_proto(keyed)).update == update
    with pytest.raises(ProtocolError, match="peer_key"):
        protocol.order_from_proto(protocol.order_to_proto(dataclasses.replace(order, peer_key=b"short")))


def test_a_worker_holds_its_last_rounds_pieces_and_serves_them_only_with_the_peer_key():
    held = HeldPieces(rounds=2)
    digests = [held.keep(r, f"payload of round {r}".encode()) for r in range(4)]
    assert [held.get(d) is not None for d in digests] == [False, False, True, True]
    assert held.get(digests[3]) == b"payload of round 3"
    # A payload it sent is held as it is and serialized when a peer first asks; older rounds drop out alike.
    sent, lazy = _payloads(1)[0], HeldPieces(rounds=2)
    lazy.keep(3, b"payload of round 3")
    lazy.keep_payload(4, sent)
    assert lazy.get(digest_of(payload_bytes(sent))) == payload_bytes(sent)
    assert lazy.get(digests[3]) == b"payload of round 3"
    lazy.keep_payload(6, sent)  # round 6: round 4's copy and round 3's piece are past the last 2 rounds
    assert len(lazy) == 1 and lazy.get(digests[3]) is None

    from gradwire.worker.engine import WorkerEngine  # a worker with one session that relays

    engine = WorkerEngine("cpu")
    engine.pull_wait = 0.0  # a piece not held is not waited for (a seed's order on its way would be)
    session = type("S", (), {"peer_key": b"k" * 32, "held": held})()
    engine.sessions["run"] = session  # type: ignore[assignment]
    assert engine.pull_piece(PieceRequest("run", b"k" * 32, digests[3])) == b"payload of round 3"
    with pytest.raises(AccessDenied):
        engine.pull_piece(PieceRequest("run", b"x" * 32, digests[3]))
    with pytest.raises(AccessDenied):
        engine.pull_piece(PieceRequest("other", b"k" * 32, digests[3]))
    with pytest.raises(NotHeld):
        engine.pull_piece(PieceRequest("run", b"k" * 32, digests[0]))  # evicted
    with pytest.raises(ProtocolError, match="digest"):
        protocol.piece_pull_from_proto(pb.PullPieceRequest(run_id="run", peer_key=b"k" * 32, digest=b"x"))


def test_the_coordinator_names_a_sender_unless_it_is_tunnelled_or_failed_lately():
    piece = Held(b"d" * 32, 100, "10.0.0.1:50051")
    assert sources(piece, {}, 5) == (("10.0.0.1:50051",), "")
    named, why = sources(Held(b"d" * 32, 100, TUNNEL_PREFIX + "w1"), {}, 5)
    assert named == () and "tunnelled" in why
    named, why = sources(piece, {"10.0.0.1:50051": 5}, 5 + QUIET_ROUNDS - 1)
    assert named == () and "failed in round 5" in why
    assert sources(piece, {"10.0.0.1:50051": 5}, 5 + QUIET_ROUNDS)[0] == ("10.0.0.1:50051",)

    payloads = _payloads(3)
    relay = Relay(enabled=True)
    relay.hold([held_piece(p, f"10.0.0.{i}:1") for i, p in enumerate(payloads)])
    whole = StateUpdate(0.5, tuple(payloads), (1.0, 1.0, 1.0))
    for_1 = relay.update_for(whole.without(1, round=4), 5)
    assert [r.position for r in for_1.relayed] == [0, 2] and for_1.payloads == ()
    assert for_1.relayed[0].digest == digest_of(payload_bytes(payloads[0]))
    relay.unreachable(["10.0.0.2:1"], 5)
    assert [r.position for r in relay.update_for(whole.without(1, round=4), 5).relayed] == [0]
    relay.hold(())  # the next update is no replay of these payloads: nothing is named
    assert relay.update_for(whole, 6) == whole


@pytest.mark.parametrize("n, fanout", [(1, 2), (2, 2), (8, 2), (100, 3), (1024, 2)])
def test_an_aggregate_spreads_down_a_tree_where_each_worker_serves_at_most_the_fanout(n, fanout):
    receivers = [f"10.0.{i // 256}.{i % 256}:1" for i in range(n)]
    serves = {r: i % 7 != 3 for i, r in enumerate(receivers)}  # some cannot serve (tunnelled, failed lately)
    tree = fanout_tree(receivers, fanout, serves)
    assert set(tree) == set(receivers)
    inline = [r for r in receivers if not tree[r]]
    seeds = [r for r in receivers if serves[r]][:fanout]
    assert sorted(inline) == sorted([r for r in receivers if not serves[r]] + seeds)  # what the coordinator sends
    parents = [tree[r][0] for r in receivers if tree[r]]
    assert all(serves[p] for p in parents) and max((parents.count(p) for p in parents), default=0) <= fanout
    # Every puller reaches a seed: no cycle, and the depth grows with the log of the workers.
    depth = {r: 0 for r in inline}
    for r in receivers:  # parents come before their children in round order
        if tree[r]:
            assert tree[r][0] in depth
            depth[r] = depth[tree[r][0]] + 1
            assert len(tree[r]) == 1 or not tree[tree[r][1]]  # the fallback is a seed
    assert max(depth.values()) <= max(1, math.ceil(math.log(max(n, 2), fanout)))


def test_a_result_names_failed_sources_when_unreachable_or_when_another_served():
    from gradwire.protocol import BEHIND, OK, UNREACHABLE, RoundResult, result_from_proto, result_to_proto

    payload = _payloads(1)[0]
    ok = RoundResult(OK, 3, gradient=payload, tokens=8, version=2, unreachable_peers=("10.0.0.1:1",))
    assert result_from_proto(result_to_proto(ok)).unreachable_peers == ("10.0.0.1:1",)
    gone = RoundResult(UNREACHABLE, 3, "none served", version=2, unreachable_peers=("10.0.0.1:1",))
    assert result_from_proto(result_to_proto(gone)).unreachable_peers == ("10.0.0.1:1",)
    for bad in (
        dataclasses.replace(gone, unreachable_peers=()),
        RoundResult(BEHIND, 3, "", version=1, unreachable_peers=("a",)),
    ):
        with pytest.raises(ProtocolError, match="unreachable"):
            result_from_proto(result_to_proto(bad))


def test_an_adamw_delta_is_relayed_as_the_delta():
    delta = _payloads(1)[0]
    update = StateUpdate(0.25, delta=delta)
    relayed = update.relaying_delta(_ref(0, delta))
    assert relayed.delta is None and relayed.relayed_delta and relayed.nbytes == 0
    wire = protocol.update_from_proto(protocol.update_to_proto(relayed))
    assert wire == relayed
    assert wire.with_pulled({0: delta}) == update
    with pytest.raises(ValueError, match="position 0"):
        update.relaying_delta(_ref(1, delta))
    m = protocol.update_to_proto(relayed)
    m.delta_piece.position = 1
    with pytest.raises(ProtocolError, match="not another sender"):
        protocol.update_from_proto(m)
