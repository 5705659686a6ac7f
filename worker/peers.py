"""A worker's calls to its peers: a gossiping worker's to its neighbours (``coordinator train --topology ...
--peer-to-peer``), and a relayed star round's for the payloads its order names (``--relay peers``,
``pull_pieces``: from the first source that answers the digest's bytes).

In a peer-to-peer gossip round the coordinator relays no message: it tells each worker, with its order,
which accepted message of the last round to take from which neighbour, at which address, with which
SHA-256 (the digest the neighbour reported). ``Peers.pull`` asks the neighbours for them in parallel
(``Worker.PullGossip``), each call with a deadline, checks each answer's digest and content, and returns the
messages for ``worker.gossip.take_links`` to add as it adds relayed ones.

Calls carry this worker's token (the swarm shares one) and the order's peer key, never a run key, and go
over TLS as ``--peer-tls`` / ``--peer-tls-ca`` say. A neighbour that cannot be reached, no longer holds
the message or answers other bytes fails the round with ``PeersUnreachable`` naming it, before any copy
changed; the round answers that as a status, and the coordinator sends this worker its copies whole in its
next round and relays that neighbour's messages to it from then on.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from gradwire import protocol
from gradwire.compression import CompressedGradient
from gradwire.errors import Cancelled, NotHeld, PeersUnreachable
from gradwire.protocol import GossipPieceRequest, GossipPull, PieceRequest, ProtocolError
from gradwire.relay import PieceRef, digest_of
from gradwire.security import ClientSecurity
from gradwire.transport import DEFAULT_MESSAGE_MB, grpc_options
from gradwire.v1 import worker_pb2_grpc

MAX_PARALLEL = 8


class Peers:
    """Pulls gossip messages from neighbours; one channel per neighbour address, kept between rounds."""

    def __init__(
        self, security: ClientSecurity | None = None, timeout: float = 30.0, max_message_mb: int = DEFAULT_MESSAGE_MB
    ) -> None:
        self.security = security or ClientSecurity()
        self.timeout = timeout
        self.max_bytes = max_message_mb << 20
        self._metadata = self.security.metadata(run_key=False)  # the token only: the peer key is in the request
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def pull(
        self, run_id: str, key: bytes, pulls: Mapping[str, GossipPull], cancelled: Callable[[], bool] = lambda: False
    ) -> dict[str, CompressedGradient]:
        """Each neighbour's message that ``pulls`` names, by member; ``PeersUnreachable`` naming every neighbour
        whose message did not come (in member order), ``Cancelled`` if the round was cancelled meanwhile."""
        if not pulls:
            return {}
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(pulls)), thread_name_prefix="gradwire-peer") as ex:
            futures = {j: ex.submit(self._pull_one, run_id, key, p) for j, p in sorted(pulls.items())}
            out, failed = {}, {}
            for j, f in futures.items():
                try:
                    out[j] = f.result()
                except NotHeld as e:
                    failed[j] = str(e)
        if cancelled():
            raise Cancelled("the round was cancelled while it pulled its neighbours' messages")
        if failed:
            raise PeersUnreachable("; ".join(failed.values()), tuple(failed))
        return out

    def _pull_one(self, run_id: str, key: bytes, pull: GossipPull) -> CompressedGradient:
        who = f"neighbour {pull.member!r} at {pull.address}"
        data = self._fetch(pull.address, GossipPieceRequest(run_id, key, pull.round), who)
        if hashlib.sha256(data).digest() != pull.digest:
            raise NotHeld(f"{who}: the message it sent is not the one it reported to the coordinator")
        try:
            return protocol.message_from_piece(data, pull.member, pull.round)
        except ValueError as e:
            raise NotHeld(f"{who}: {e}") from None

    def pull_pieces(
        self, run_id: str, key: bytes, refs: Sequence[PieceRef], cancelled: Callable[[], bool] = lambda: False
    ) -> tuple[dict[bytes, tuple[CompressedGradient, bytes]], tuple[str, ...]]:
        """Each relayed payload ``refs`` name (``gradwire.relay``), by digest, with its bytes: from the first of
        its sources that answers exactly its bytes, each source asked with a deadline; and the sources that
        failed before another served. ``PeersUnreachable`` naming every source that failed, when some payload
        came from none; ``Cancelled`` if the round was cancelled meanwhile."""
        unique = list({r.digest: r for r in refs}.values())
        if not unique:
            return {}, ()
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(unique)), thread_name_prefix="gradwire-peer") as ex:
            futures = [ex.submit(self._piece, run_id, key, r) for r in unique]
            results = [f.result() for f in futures]
        if cancelled():
            raise Cancelled("the round was cancelled while it pulled its relayed payloads")
        out, failed, why = {}, [], []
        for ref, (got, errors) in zip(unique, results):
            failed += [a for a in errors if a not in failed]
            if got is None:
                why.append(f"payload at position {ref.position}: " + "; ".join(errors.values()))
            else:
                out[ref.digest] = got
        if len(out) < len(unique):
            raise PeersUnreachable("; ".join(why), tuple(failed))
        return out, tuple(failed)

    def _piece(
        self, run_id: str, key: bytes, ref: PieceRef
    ) -> tuple[tuple[CompressedGradient, bytes] | None, dict[str, str]]:
        """``ref``'s payload and bytes from the first source that has them (None if none did), and why each
        source asked before failed."""
        errors: dict[str, str] = {}
        for address in ref.sources:
            who = f"peer {address}"
            try:
                data = self._fetch_piece(address, PieceRequest(run_id, key, ref.digest), ref.size, who)
                if len(data) != ref.size or digest_of(data) != ref.digest:
                    raise NotHeld(f"{who}: answered {len(data)} bytes that are not the payload asked for")
                return (protocol.relayed_payload(data), data), errors
            except (NotHeld, ProtocolError) as e:
                errors[address] = str(e)
        return None, errors

    def _fetch_piece(self, address: str, request: PieceRequest, size: int, who: str) -> bytes:
        """The bytes ``address`` answers to ``request`` (at most ``size``); ``NotHeld`` saying why they did not come."""
        stub = worker_pb2_grpc.WorkerStub(self._channel(address))
        call = stub.PullPiece(protocol.piece_pull_to_proto(request), timeout=self.timeout, metadata=self._metadata)
        return self._joined(call, min(size, self.max_bytes), f"{who}: the payload")

    def _fetch(self, address: str, request: GossipPieceRequest, who: str) -> bytes:
        """The serialized piece ``request`` asks ``address`` for; ``NotHeld`` saying why it did not come."""
        stub = worker_pb2_grpc.WorkerStub(self._channel(address))
        call = stub.PullGossip(protocol.piece_request_to_proto(request), timeout=self.timeout, metadata=self._metadata)
        return self._joined(call, self.max_bytes, f"{who}: its message of round {request.round}")

    @staticmethod
    def _joined(call: Iterator[Any], max_bytes: int, what: str) -> bytes:
        """The framed bytes a streaming pull answers; ``NotHeld`` saying why ``what`` did not come."""
        try:
            return protocol.join_parts(call, max_bytes)
        except grpc.RpcError as e:
            code = e.code().name if callable(getattr(e, "code", None)) else "UNKNOWN"
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            raise NotHeld(f"{what} did not come ({code}: {details})") from None
        except ValueError as e:
            raise NotHeld(f"{what}: the answer is malformed ({e})") from None

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = self.security.channel(address, grpc_options())
            return self._channels[address]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
