"""Workers in this process: a ``gradwire.link.WorkerLink`` that calls a ``WorkerEngine`` directly.

For simulations and benchmarks that want the service's exact logic without gRPC (``benchmarks.quality``
trains several methods side by side this way): the coordinator's ``Trainer`` and the worker's engine run
unchanged, and every message still goes through the protocol's serde both ways, so byte counts are those
of the serialized messages the wire would carry (without the gRPC framing).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from google.protobuf.message import Message

from gradwire import protocol, statestream
from gradwire.compression import CompressedGradient
from gradwire.errors import AccessDenied, NotHeld, status_for
from gradwire.link import OnPiece, Traffic, WorkerError
from gradwire.protocol import (
    GossipPieceRequest,
    ModelState,
    PieceRequest,
    ProtocolError,
    RoundResult,
    WorkerInfo,
    WorkerState,
    WorkOrder,
)
from gradwire.replica import Fingerprint
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.peers import Peers

T = TypeVar("T")


class InProcessClient:
    """A ``WorkerLink`` to an engine in this process; ``timeout`` arguments are accepted and ignored."""

    def __init__(self, engine: WorkerEngine, address: str = "in-process") -> None:
        self.engine = engine
        self.address = address
        self._cancelled = threading.Event()

    def wait_ready(self, timeout: float | None = None) -> None:
        return None

    def describe(self, timeout: float | None = None) -> WorkerInfo:
        return self.engine.info()

    def push_state(self, state: ModelState, timeout: float | None = None) -> tuple[tuple[int, Fingerprint], Traffic]:
        parts = statestream.state_parts(state)  # the wire's bytes, streamed, as a worker reads them
        first = next(parts)
        answer = self._served(lambda: self.engine.push_parts(itertools.chain([first], parts), sys.maxsize))
        return answer, Traffic(first.total_bytes, 0)

    def run_round(
        self, order: WorkOrder, timeout: float | None = None, on_piece: OnPiece | None = None
    ) -> tuple[RoundResult, Traffic]:
        down = protocol.order_to_proto(order)
        self._cancelled.clear()
        order = protocol.order_from_proto(_wire(down, pb.WorkOrder))
        pieces = []  # a streamed gradient's, as the wire carries them

        def emit(piece: CompressedGradient) -> None:
            pieces.append(_wire(protocol.piece_to_proto(order.round, piece), pb.RoundResult))

        result = self._served(lambda: self.engine.run_round(order, cancelled=self._cancelled.is_set, emit=emit))
        if pieces and result.gradient is not None:  # the last message leaves out what the pieces carried
            result = dataclasses.replace(result, gradient=dataclasses.replace(result.gradient, tensors=()))
        up = protocol.result_to_proto(result)
        for piece in pieces:
            if on_piece is None:
                raise ProtocolError("a streamed gradient for a caller that takes no pieces")
            on_piece(protocol.piece_from_proto(piece))
        up_bytes = up.ByteSize() + sum(p.ByteSize() for p in pieces)
        return protocol.result_from_proto(_wire(up, pb.RoundResult)), Traffic(down.ByteSize(), up_bytes)

    def fetch_worker_state(self, run_id: str, timeout: float | None = None) -> tuple[WorkerState, Traffic]:
        up = protocol.worker_state_to_proto(self._served(lambda: self.engine.worker_state(run_id)))
        return protocol.worker_state_from_proto(_wire(up, pb.WorkerState)), Traffic(0, up.ByteSize())

    def pull_gossip(self, request: GossipPieceRequest, timeout: float | None = None) -> tuple[pb.GossipPiece, Traffic]:
        data = self._served(lambda: self.engine.pull_gossip(request))
        return protocol.parse(pb.GossipPiece, data), Traffic(0, len(data))

    def cancel(self) -> None:
        self._cancelled.set()

    def close_run(self, run_id: str, timeout: float | None = None) -> bool:
        return self.engine.close_run(run_id)

    def close(self) -> None:
        return None

    def _served(self, call: Callable[[], T]) -> T:
        """``call()``, failing as the servicer would answer it; a bug (no status) surfaces as itself."""
        try:
            return call()
        except Exception as e:
            status = status_for(e)
            if status is None:
                raise
            raise WorkerError(self.address, *status) from None


def _wire(message: Message, cls: type[Message]) -> Message:
    """The message as the other side parses it: serialized and parsed again, as on the wire."""
    return protocol.parse(cls, message.SerializeToString())


class InProcessPeers(Peers):
    """Peer-to-peer gossip among in-process workers: a neighbour's address names its engine here."""

    def __init__(self, engines: Mapping[str, WorkerEngine]) -> None:
        super().__init__()
        self.engines = engines

    def _fetch(self, address: str, request: GossipPieceRequest, who: str) -> bytes:
        engine = self.engines.get(address)
        if engine is None:
            raise NotHeld(f"{who}: no worker at that address in this process")
        try:
            return engine.pull_gossip(request)
        except (NotHeld, AccessDenied, ValueError) as e:
            raise NotHeld(f"{who}: its message of round {request.round} did not come ({e})") from None

    def _fetch_piece(self, address: str, request: PieceRequest, size: int, who: str) -> bytes:
        engine = self.engines.get(address)
        if engine is None:
            raise NotHeld(f"{who}: no worker at that address in this process")
        try:
            data = engine.pull_piece(request)
        except (NotHeld, AccessDenied, ValueError) as e:
            raise NotHeld(f"{who}: the payload did not come ({e})") from None
        if len(data) > size:
            raise NotHeld(f"{who}: its answer is over the {size} bytes asked for")
        return data


def in_process_clients(
    n: int, device: str = "cpu", factory: Callable[[str], WorkerEngine] = WorkerEngine
) -> list[InProcessClient]:
    """``n`` workers in this process; in peer-to-peer gossip they pull from each other (``InProcessPeers``)."""
    clients = [InProcessClient(factory(device), f"in-process-{i}") for i in range(n)]
    peers = InProcessPeers({c.address: c.engine for c in clients})
    for c in clients:
        c.engine.peers = peers
    return clients
