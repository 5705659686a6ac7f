"""The coordinator's side of the Worker service: one client per worker.

Every call carries a deadline (the worker refuses calls without one), and every way a call can fail -
a gRPC status, a worker that speaks another protocol, a reply that does not parse - becomes a
``WorkerError`` carrying a ``grpc.StatusCode``. The round loop treats that as the worker's state for this
round (absent, straggling, needs a restart), never as a crash: the round loop records the error in place
of that worker's result.

The calls that move data (push, round, fetch) return their ``Traffic`` beside their answer: the data of
every framed ``Part`` in each direction, or the serialized size of a small unary message. The client
satisfies ``gradwire.link.WorkerLink``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradwire import protocol, statestream
from gradwire.link import OnPiece, Traffic, WorkerError
from gradwire.protocol import (
    PROTOCOL_VERSION,
    GossipPieceRequest,
    ModelState,
    RoundResult,
    WorkerInfo,
    WorkerState,
    WorkOrder,
)
from gradwire.replica import Fingerprint
from gradwire.security import ClientSecurity
from gradwire.transport import DEFAULT_MESSAGE_MB, SERVICE_NAME, check_message_mb, grpc_options
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc

T = TypeVar("T")

# A worker that restarts should be found again within seconds, not after grpc's default 2-minute backoff.
_CLIENT_OPTIONS = [("grpc.max_reconnect_backoff_ms", 10_000)]


class _Counter:
    """Counts the bytes of the messages that pass through ``count``."""

    def __init__(self) -> None:
        self.nbytes = 0

    def count(self, parts: Iterable[pb.Part]) -> Iterator[pb.Part]:
        for part in parts:
            self.nbytes += len(part.data)
            yield part


class WorkerClient:
    """Calls one worker. Each method takes ``timeout`` (seconds; default: the constructor's) as its deadline.

    One call at a time per client (``cancel`` aims at the one in flight), as the round loop makes them.
    ``security`` gives the channel (TLS or not) and what every call carries (the token, the run key); the
    clients of one run share it, so that the run's key is the same at every worker.
    ``channel`` replaces the one ``security`` would dial (a worker's tunnel: ``coordinator.tunnel``).
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 60.0,
        max_message_mb: int = DEFAULT_MESSAGE_MB,
        security: ClientSecurity | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.max_bytes = check_message_mb(max_message_mb) << 20
        self.security = security or ClientSecurity()
        self.call_metadata = self.security.metadata()  # what every call carries: the token, the run key
        # ``channel``: another way to the worker (``coordinator.tunnel``: through the tunnel it opened)
        self.channel = (
            channel if channel is not None else self.security.channel(address, [*grpc_options(), *_CLIENT_OPTIONS])
        )
        self._stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._in_flight: Any = None  # the streaming call in progress, for ``cancel``

    # ---------------------------------------------------------------- calls

    def describe(self, timeout: float | None = None) -> WorkerInfo:
        """The worker's versions and device; raises ``WorkerError`` if it speaks another protocol."""
        request = pb.DescribeRequest(protocol_version=PROTOCOL_VERSION)
        reply = self._call(
            lambda: self._stub.Describe(request, timeout=self._timeout(timeout), metadata=self.call_metadata)
        )
        info = protocol.info_from_proto(reply)
        if info.protocol_version != PROTOCOL_VERSION:
            details = f"speaks protocol {info.protocol_version}, this coordinator speaks {PROTOCOL_VERSION}"
            raise WorkerError(
                self.address,
                grpc.StatusCode.FAILED_PRECONDITION,
                details,
                f"worker at {self.address} {details}: upgrade the older one",
            )
        return info

    def push_state(self, state: ModelState, timeout: float | None = None) -> tuple[tuple[int, Fingerprint], Traffic]:
        """Replace the worker's replica of ``state.run_id``: its version and fingerprint, and the bytes."""
        down = _Counter()
        parts = down.count(statestream.state_parts(state))  # serialized a tensor at a time, as sent

        def push() -> pb.PushStateReply:
            call = self._stub.PushState.future(parts, timeout=self._timeout(timeout), metadata=self.call_metadata)
            self._in_flight = call  # a straggler cut-off cancels a push as it does a round
            try:
                return call.result()
            except grpc.FutureCancelledError:
                raise WorkerError(self.address, grpc.StatusCode.CANCELLED, "state push cancelled") from None
            finally:
                self._in_flight = None

        reply = self._call(push)
        answer = (reply.version, protocol.fingerprint_from_proto(reply.fingerprint))
        return answer, Traffic(down.nbytes, reply.ByteSize())

    def run_round(
        self, order: WorkOrder, timeout: float | None = None, on_piece: OnPiece | None = None
    ) -> tuple[RoundResult, Traffic]:
        """One round and its bytes; the result's gradient is structurally checked (the aggregator checks it
        against its plan). A streamed gradient's pieces go to ``on_piece`` as they arrive; together with the
        result they may hold at most the client's message limit, and there are at most ``stream_buckets``.

        A malformed ``order`` is the caller's bug and raises ``ProtocolError`` before anything is sent.
        """
        down, up = _Counter(), _Counter()
        parts = down.count(protocol.to_parts(protocol.order_to_proto(order)))

        def read(stream: Iterator[pb.Part]) -> pb.RoundResult:
            """The pieces, each to ``on_piece``, then the result."""
            budget, pieces = self.max_bytes, 0
            while (message := protocol.parse(pb.RoundResult, data := protocol.join_parts(stream, budget))).piece:
                budget -= len(data)
                pieces += 1
                if on_piece is None or pieces > order.stream_buckets:
                    raise protocol.ProtocolError(f"more than the {order.stream_buckets} pieces the order asked")
                if message.round != order.round:
                    raise protocol.ProtocolError(f"a piece of round {message.round} in round {order.round}")
                on_piece(protocol.piece_from_proto(message))
            return message

        result = self._framed(
            lambda: self._stub.RunRound(parts, timeout=self._timeout(timeout), metadata=self.call_metadata),
            up,
            pb.RoundResult,
            protocol.result_from_proto,
            read,
        )
        if result.round != order.round:
            raise WorkerError(
                self.address,
                grpc.StatusCode.DATA_LOSS,
                f"answered round {result.round} to an order for round {order.round}",
            )
        return result, Traffic(down.nbytes, up.nbytes)

    def fetch_worker_state(self, run_id: str, timeout: float | None = None) -> tuple[WorkerState, Traffic]:
        """The error feedback and inner optimizer state of the worker's session of ``run_id`` (for checkpoints)."""
        request = pb.FetchWorkerStateRequest(run_id=run_id)
        up = _Counter()
        state = self._framed(
            lambda: self._stub.FetchWorkerState(request, timeout=self._timeout(timeout), metadata=self.call_metadata),
            up,
            pb.WorkerState,
            protocol.worker_state_from_proto,
        )
        return state, Traffic(request.ByteSize(), up.nbytes)

    def pull_gossip(self, request: GossipPieceRequest, timeout: float | None = None) -> tuple[pb.GossipPiece, Traffic]:
        """A peer-to-peer gossip worker's message or public copy (``Worker.PullGossip``), and the bytes."""
        proto = protocol.piece_request_to_proto(request)
        up = _Counter()
        piece = self._framed(
            lambda: self._stub.PullGossip(proto, timeout=self._timeout(timeout), metadata=self.call_metadata),
            up,
            pb.GossipPiece,
            lambda m: m,
        )
        return piece, Traffic(proto.ByteSize(), up.nbytes)

    def close_run(self, run_id: str, timeout: float | None = None) -> bool:
        """Ask the worker to drop its session of ``run_id``; whether it held one."""
        request = pb.CloseRunRequest(run_id=run_id)
        reply = self._call(
            lambda: self._stub.CloseRun(request, timeout=self._timeout(timeout), metadata=self.call_metadata)
        )
        return reply.closed

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker is reachable and its health says SERVING; ``WorkerError`` (UNAVAILABLE) if not."""
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise WorkerError(
                self.address, grpc.StatusCode.UNAVAILABLE, f"not reachable within {timeout:g} s"
            ) from None
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        while True:
            left = deadline - time.monotonic()
            try:
                status = self._health.Check(request, timeout=max(left, 0.05)).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as e:
                last = _code(e).name
            if left <= 0:
                raise WorkerError(
                    self.address, grpc.StatusCode.UNAVAILABLE, f"not SERVING within {timeout:g} s (health: {last})"
                )
            time.sleep(min(0.1, left))

    def cancel(self) -> None:
        """Cancel the round, push or fetch in flight, if any (from another thread): it fails with CANCELLED,
        and the worker abandons a round at its next check (between micro-batches and inner steps)."""
        call = self._in_flight
        if call is not None:
            call.cancel()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- plumbing

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as e:
            raise WorkerError(self.address, _code(e), _details(e)) from None

    def _framed(
        self,
        start: Callable[[], Any],
        up: _Counter,
        cls: type[Message],
        from_proto: Callable[[Any], T],
        read: Callable[[Iterator[pb.Part]], Message] | None = None,
    ) -> T:
        """Run a call whose reply is a framed message; join, parse and check it. ``read`` reads the reply's
        parts into its message (default: one framed ``cls``); what is malformed (``ProtocolError``,
        ``PayloadError``) ends the call as a ``WorkerError`` (DATA_LOSS)."""

        def receive() -> Message:
            responses = start()
            self._in_flight = responses
            try:
                stream = up.count(responses)
                message = read(stream) if read else protocol.parse(cls, protocol.join_parts(stream, self.max_bytes))
                for _ in responses:  # also surfaces a status the worker sent after the parts
                    raise protocol.ProtocolError("parts after the last one")
            except ValueError:
                responses.cancel()
                raise
            finally:
                self._in_flight = None
            return message

        try:
            return from_proto(self._call(receive))
        except ValueError as e:
            raise WorkerError(
                self.address, grpc.StatusCode.DATA_LOSS, f"sent a malformed {cls.__name__}: {e}"
            ) from None


def _code(e: grpc.RpcError) -> grpc.StatusCode:
    code = getattr(e, "code", None)
    return code() if callable(code) else grpc.StatusCode.UNKNOWN


def _details(e: grpc.RpcError) -> str:
    details = getattr(e, "details", None)
    return (details() if callable(details) else None) or str(e)
