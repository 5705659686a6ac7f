"""``worker serve --join HOST:PORT --tunnel``: reach the coordinator from behind NAT.

The worker opens ``Coordinator.Tunnel`` to the coordinator and holds it open (reopening it a few seconds
after it drops, as ``Joiner`` repeats Join); the coordinator's calls arrive inside it as frames, and
``TunnelRelay`` makes each one a real call to this worker's own server over a local socket, so a call
through the tunnel passes the same interceptors (token, deadline, malformed requests) and the same
servicer as one over a direct connection. Only the Worker methods and health Check are relayed
(UNIMPLEMENTED for any other), at most ``MAX_CALLS`` at a time, each with the deadline its frame gives.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from gradwire.protocol import PROTOCOL_VERSION
from gradwire.security import ClientSecurity
from gradwire.transport import grpc_options
from gradwire.tunnel import (
    MAX_CALLS,
    MAX_DETAILS_CHARS,
    METHODS,
    QUEUED_MESSAGES,
    TUNNEL_SECONDS,
    check_metadata,
    check_name,
    identity,
    put_while,
)
from gradwire.v1 import coordinator_pb2 as pb
from gradwire.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)

_END = object()  # no more requests on a call
MAX_CALL_SECONDS = 7 * 24 * 3600.0


class _LocalCall:
    """One relayed call: requests from the tunnel into a call on the local server, its replies back."""

    def __init__(
        self, relay: TunnelRelay, call_id: int, method: str, timeout: float, metadata: list[tuple[str, str]]
    ) -> None:
        self.relay, self.id, self.method, self.timeout, self.metadata = relay, call_id, method, timeout, metadata
        self.requests: queue.Queue[Any] = queue.Queue(maxsize=QUEUED_MESSAGES)
        self.cancelled = threading.Event()
        self._local: Any = None  # the local call (a future or a response iterator), for ``cancel``

    def put(self, item: Any) -> None:
        put_while(self.requests, item, lambda: not self.cancelled.is_set())

    def cancel(self) -> None:
        self.cancelled.set()
        local = self._local
        if local is not None:
            local.cancel()

    def _requests(self, deadline: float) -> Iterator[bytes]:
        while not self.cancelled.is_set() and time.monotonic() < deadline:
            try:
                item = self.requests.get(timeout=0.25)
            except queue.Empty:
                continue
            if item is _END:
                return
            yield item

    def run(self) -> None:
        streams_requests, streams_responses = METHODS[self.method]
        channel = self.relay.local_channel
        kind = ("unary_" if not streams_requests else "stream_") + ("stream" if streams_responses else "unary")
        method = getattr(channel, kind)(self.method, request_serializer=identity, response_deserializer=identity)
        deadline = time.monotonic() + self.timeout
        try:
            if streams_requests:
                request: Any = self._requests(deadline)
            else:
                request = next(self._requests(deadline), None)
                if request is None:
                    if self.cancelled.is_set():
                        raise _Status(grpc.StatusCode.CANCELLED, "cancelled")
                    if time.monotonic() >= deadline:
                        raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "no request message before the deadline")
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request arrived")
            if streams_responses:
                self._local = responses = method(request, timeout=left, metadata=self.metadata)
                if self.cancelled.is_set():
                    responses.cancel()
                for message in responses:
                    self.relay.send(pb.TunnelFrame(call=self.id, message=message))
            else:
                self._local = future = method.future(request, timeout=left, metadata=self.metadata)
                if self.cancelled.is_set():
                    future.cancel()
                self.relay.send(pb.TunnelFrame(call=self.id, message=future.result()))
            status = (grpc.StatusCode.OK, "")
        except _Status as e:
            status = (e.code, e.details)
        except grpc.RpcError as e:
            status = (
                (e.code(), e.details() or "")
                if callable(getattr(e, "code", None))
                else (grpc.StatusCode.UNKNOWN, str(e))
            )
        except grpc.FutureCancelledError:
            status = (grpc.StatusCode.CANCELLED, "cancelled")
        except _Closed:
            return
        finally:
            self.relay.forget(self.id)
        try:
            self.relay.send(
                pb.TunnelFrame(
                    call=self.id, status=pb.TunnelStatus(code=status[0].value[0], details=status[1][:MAX_DETAILS_CHARS])
                )
            )
        except _Closed:
            pass


class _Status(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Closed(Exception):
    """The tunnel closed while a frame waited to be sent."""


class TunnelRelay:
    """Holds a tunnel open to ``coordinator`` under ``name`` and relays the calls in it to ``local`` (this
    worker's own server, e.g. ``unix:/path``); reopens it ``every`` seconds after it drops, until ``stop``."""

    def __init__(
        self, coordinator: str, name: str, local: str, *, security: ClientSecurity | None = None, every: float = 5.0
    ) -> None:
        self.coordinator, self.name, self.every = coordinator, check_name(name), every
        security = security or ClientSecurity()
        self._metadata = security.metadata(run_key=False)
        self._channel = security.channel(coordinator, grpc_options())
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self.local_channel = grpc.insecure_channel(local, grpc_options())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gradwire-tunnel", daemon=True)
        self._calls: dict[int, _LocalCall] = {}
        self._lock = threading.Lock()
        self._out: queue.Queue[pb.TunnelFrame] | None = None
        self._tunnel: Any = None
        self.opened = 0  # tunnels opened so far
        self._last_error = ""

    def start(self) -> TunnelRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        tunnel = self._tunnel
        if tunnel is not None:
            tunnel.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._channel.close()
        self.local_channel.close()

    # ------------------------------------------------------------------ the tunnel

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self.every)

    def run_once(self) -> None:
        """Open one tunnel and relay until it ends."""
        out: queue.Queue[pb.TunnelFrame] = queue.Queue(maxsize=2 * QUEUED_MESSAGES)
        out.put(pb.TunnelFrame(hello=pb.TunnelHello(protocol_version=PROTOCOL_VERSION, name=self.name)))
        ended = threading.Event()
        self._out = out
        try:
            self._tunnel = frames = self._stub.Tunnel(
                self._outbound(out, ended), timeout=TUNNEL_SECONDS, metadata=self._metadata
            )
            for frame in frames:
                self._handle(frame)
            self._note("")
        except grpc.RpcError as e:
            if not self._stop.is_set():
                self._note(f"the tunnel to {self.coordinator} ended: {e.code().name}: {e.details()}")
        finally:
            ended.set()
            self._out = None
            with self._lock:
                calls = list(self._calls.values())
            for call in calls:
                call.cancel()

    def _outbound(self, out: queue.Queue[pb.TunnelFrame], ended: threading.Event) -> Iterator[pb.TunnelFrame]:
        first = True
        while not ended.is_set():
            try:
                frame = out.get(timeout=0.25)
            except queue.Empty:
                continue
            yield frame
            if first:  # the hello is on its way: the tunnel is open as far as this end can tell
                first = False
                self.opened += 1
                log.info("tunnel open to the coordinator at %s as %s", self.coordinator, self.name)

    def _note(self, error: str) -> None:
        if error and error != self._last_error:
            log.warning("%s; reopening every %.0f s", error, self.every)
        self._last_error = error

    def send(self, frame: pb.TunnelFrame) -> None:
        """Queue a frame for the coordinator (waiting for room while the tunnel lasts)."""
        while True:
            out = self._out
            if out is None or self._stop.is_set():
                raise _Closed
            try:
                out.put(frame, timeout=0.25)
                return
            except queue.Full:
                continue

    def forget(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ frames from the coordinator

    def _handle(self, frame: pb.TunnelFrame) -> None:
        kind = frame.WhichOneof("kind")
        with self._lock:
            call = self._calls.get(frame.call)
        if kind == "open":
            self._open(frame.call, frame.open, exists=call is not None)
        elif call is None:
            return  # a call that has ended (or never was): late frames are dropped
        elif kind == "message":
            call.put(frame.message)
        elif kind == "half_close":
            call.put(_END)
        elif kind == "cancel":
            call.cancel()

    def _open(self, call_id: int, opening: pb.TunnelOpen, *, exists: bool) -> None:
        def refuse(code: grpc.StatusCode, details: str) -> None:
            self.send(
                pb.TunnelFrame(
                    call=call_id, status=pb.TunnelStatus(code=code.value[0], details=details[:MAX_DETAILS_CHARS])
                )
            )

        if call_id == 0 or exists:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, f"call {call_id} is not a new call id")
        if opening.method not in METHODS:
            return refuse(grpc.StatusCode.UNIMPLEMENTED, f"{opening.method[:200]!r} is not relayed through a tunnel")
        timeout = opening.timeout_seconds
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_CALL_SECONDS):
            return refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a deadline of {timeout} s; calls need one of at most {MAX_CALL_SECONDS:.0f} s",
            )
        try:
            metadata = check_metadata([(m.key, m.value) for m in opening.metadata])
        except ValueError as e:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        call = _LocalCall(self, call_id, opening.method, timeout, metadata)
        with self._lock:
            if len(self._calls) >= MAX_CALLS:
                busy = True
            else:
                busy = False
                self._calls[call_id] = call
        if busy:
            return refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_CALLS} calls through this tunnel already")
        threading.Thread(target=call.run, name=f"gradwire-relay-{call_id}", daemon=True).start()
        return None
