"""The coordinator's end of worker tunnels: calls to a worker it cannot dial.

A worker behind NAT (``worker serve --join HOST:PORT --tunnel``) opens ``Coordinator.Tunnel`` on the
coordinator's ``--listen`` port and holds it open. ``Tunnels`` keeps the open ones by the worker's name;
``TunnelChannel`` is a ``grpc.Channel`` whose calls travel through the named tunnel, so ``WorkerClient`` -
deadlines, cancellation, byte counts, error handling - works unchanged over it: the worker's stubs and
health stub are built on it as on any channel.

Everything a worker sends is checked before it is kept: a first frame that is not a hello with this
protocol and a valid name ends the tunnel with INVALID_ARGUMENT or FAILED_PRECONDITION; frames for calls
that are not open are dropped; at most ``QUEUED_MESSAGES`` messages wait per call (the worker's sends then
wait, through HTTP/2 flow control), and the calls' own code (``WorkerClient``) bounds what a reply may
assemble to. A tunnel that closes fails its calls in flight with UNAVAILABLE; a worker that opens a
tunnel under a name already open replaces the old one (a restart).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gradwire.protocol import PROTOCOL_VERSION
from gradwire.tunnel import (
    MAX_CALLS,
    MAX_DETAILS_CHARS,
    QUEUED_MESSAGES,
    TUNNEL_PREFIX,
    check_name,
    identity,
    put_while,
    status_code,
)
from gradwire.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

MAX_TUNNELS = 64
_POLL = 0.25  # seconds between checks of a closed tunnel or a cancelled call while waiting


class TunnelError(grpc.RpcError):
    """A call through a tunnel failed; quacks like the ``grpc.RpcError`` of a call (``code``, ``details``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# ------------------------------------------------------------------------------------------ one tunnel


class _Call:
    """One call in flight through a link: the coordinator's side of its frames."""

    def __init__(self, link: TunnelLink, call_id: int, deadline: float) -> None:
        self.link, self.id, self.deadline = link, call_id, deadline
        self.inbox: queue.Queue[bytes | tuple[grpc.StatusCode, str]] = queue.Queue(maxsize=QUEUED_MESSAGES)
        self.ended = threading.Event()  # a status arrived, or the caller gave up

    def send(self, **kind: Any) -> None:
        self.link.send(pb.TunnelFrame(call=self.id, **kind), self.deadline, self.ended)

    def deliver(self, item: bytes | tuple[grpc.StatusCode, str]) -> None:
        """From the link's reader: wait (bounded by the call's life) for room in the inbox."""
        put_while(self.inbox, item, lambda: not self.ended.is_set(), _POLL)

    def receive(self) -> bytes | None:
        """The next response message; ``None`` once the call ended OK; ``TunnelError`` otherwise."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.cancel()
                raise TunnelError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded (through the tunnel)")
            try:
                item = self.inbox.get(timeout=min(left, _POLL))
            except queue.Empty:
                if self.ended.is_set():
                    raise TunnelError(grpc.StatusCode.CANCELLED, "cancelled") from None
                if self.link.closed.is_set():
                    self.finish()
                    raise TunnelError(
                        grpc.StatusCode.UNAVAILABLE, f"the worker's tunnel closed: {self.link.reason}"
                    ) from None
                continue
            if isinstance(item, bytes):
                return item
            self.finish()
            code, details = item
            if code is grpc.StatusCode.OK:
                return None
            raise TunnelError(code, details)

    def cancel(self) -> None:
        if not self.ended.is_set():
            self.finish()
            try:
                self.link.send(pb.TunnelFrame(call=self.id, cancel=True), time.monotonic() + 1.0, None)
            except TunnelError:
                pass  # the tunnel is gone: the worker's relay cancels everything then anyway

    def finish(self) -> None:
        self.ended.set()
        self.link.forget(self.id)


class TunnelLink:
    """One open tunnel: frames out to the worker (a bounded queue the Tunnel handler streams from) and the
    calls in flight, fed by ``feed`` from the worker's frames."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = threading.Event()
        self.reason = ""
        self.malformed = ""  # the worker sent a frame that does not parse: the tunnel ends INVALID_ARGUMENT
        self._out: queue.Queue[pb.TunnelFrame | None] = queue.Queue(maxsize=2 * QUEUED_MESSAGES)
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open_call(self, method: str, timeout: float, metadata: list[tuple[str, str]]) -> _Call:
        deadline = time.monotonic() + timeout
        with self._lock:
            if self.closed.is_set():
                raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"the worker's tunnel closed: {self.reason}")
            if len(self._calls) >= MAX_CALLS:
                raise TunnelError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_CALLS} calls in flight through the tunnel already"
                )
            call = _Call(self, next(self._ids), deadline)
            self._calls[call.id] = call
        opening = pb.TunnelOpen(
            method=method, timeout_seconds=timeout, metadata=[pb.TunnelMetadata(key=k, value=v) for k, v in metadata]
        )
        call.send(open=opening)
        return call

    def send(self, frame: pb.TunnelFrame, deadline: float, ended: threading.Event | None) -> None:
        """Queue ``frame`` for the worker, waiting for room until ``deadline`` (or the call or tunnel ends)."""
        while True:
            if self.closed.is_set():
                raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"the worker's tunnel closed: {self.reason}")
            if ended is not None and ended.is_set():
                raise TunnelError(grpc.StatusCode.CANCELLED, "cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TunnelError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded sending through the tunnel")
            try:
                self._out.put(frame, timeout=min(left, _POLL))
                return
            except queue.Full:
                continue

    def outbound(self) -> Iterator[pb.TunnelFrame]:
        """The frames for the worker, until the tunnel closes (the Tunnel handler's response stream)."""
        while True:
            try:
                frame = self._out.get(timeout=_POLL)
            except queue.Empty:
                if self.closed.is_set():
                    return
                continue
            if frame is None:
                return
            yield frame

    def feed(self, frames: Iterator[pb.TunnelFrame]) -> None:
        """Read the worker's frames until its stream ends; then close."""
        reason = "the worker closed it"
        try:
            for frame in frames:
                kind = frame.WhichOneof("kind")
                with self._lock:
                    call = self._calls.get(frame.call)
                if call is None:
                    continue  # a call that ended (cancelled, timed out): its late frames are dropped
                if kind == "message":
                    call.deliver(frame.message)
                elif kind == "status":
                    call.deliver((status_code(frame.status.code), frame.status.details[:MAX_DETAILS_CHARS]))
                # anything else is not the worker's to send on a call: ignored
        except ValueError as e:  # gradwire.interceptors.RejectMalformed: a frame that does not parse
            reason = self.malformed = str(e)[:MAX_DETAILS_CHARS]
        except grpc.RpcError as e:
            reason = f"{getattr(e, 'code', lambda: None)() or 'ended'}"
        except Exception as e:  # noqa: BLE001 - the reader must end by closing the link whatever happened
            reason = f"{type(e).__name__}: {e}"
        finally:
            self.close(reason)

    def forget(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def close(self, reason: str) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.reason = reason
            self.closed.set()
        try:
            self._out.put_nowait(None)  # wake the handler; if the queue is full it sees ``closed`` within _POLL
        except queue.Full:
            pass


# ------------------------------------------------------------------------------------------ registry


class Tunnels:
    """The open tunnels by worker name; ``serve`` runs one for the Tunnel handler; ``channel`` calls one."""

    def __init__(
        self, *, on_open: Callable[[str], None] | None = None, on_close: Callable[[str], None] | None = None
    ) -> None:
        self._links: dict[str, TunnelLink] = {}
        self._lock = threading.Lock()
        self._watchers: dict[str, list[Callable[[grpc.ChannelConnectivity], None]]] = {}
        self.on_open, self.on_close = on_open, on_close

    def get(self, name: str) -> TunnelLink | None:
        with self._lock:
            link = self._links.get(name)
        return link if link is not None and not link.closed.is_set() else None

    def channel(self, name: str) -> TunnelChannel:
        return TunnelChannel(self, name)

    def serve(self, frames: Iterator[pb.TunnelFrame], context: grpc.ServicerContext) -> Iterator[pb.TunnelFrame]:
        """The Tunnel handler: check the hello, hold the link open while the worker keeps its stream."""
        try:
            hello = next(frames)
        except StopIteration:
            return
        except ValueError as e:  # gradwire.interceptors.RejectMalformed: the first frame does not parse
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)[:MAX_DETAILS_CHARS])
        if hello.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a tunnel starts with a hello frame")
        if hello.hello.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this coordinator speaks protocol {PROTOCOL_VERSION}, the worker {hello.hello.protocol_version}: "
                "upgrade the older one",
            )
        try:
            name = check_name(hello.hello.name)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        link = TunnelLink(name)
        with self._lock:
            old = self._links.get(name)
            if old is None and len(self._links) >= MAX_TUNNELS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_TUNNELS} tunnels are open already")
            self._links[name] = link
        if old is not None:
            old.close("replaced by a new tunnel from the same worker")
        log.info("%s%s opened a tunnel from %s", TUNNEL_PREFIX, name, context.peer())
        context.add_callback(lambda: link.close("the call ended"))
        reader = threading.Thread(target=link.feed, args=(frames,), name=f"gradwire-tunnel-{name}", daemon=True)
        reader.start()
        self._notify(name, grpc.ChannelConnectivity.READY)
        if self.on_open is not None:
            self.on_open(name)
        try:
            yield from link.outbound()
            if link.malformed:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, link.malformed)
        finally:
            link.close(link.reason or "the call ended")
            with self._lock:
                mine = self._links.get(name) is link
                if mine:
                    del self._links[name]
            if mine:
                log.info("%s%s closed its tunnel: %s", TUNNEL_PREFIX, name, link.reason)
                self._notify(name, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
                if self.on_close is not None:
                    self.on_close(name)

    def watch(self, name: str, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        with self._lock:
            self._watchers.setdefault(name, []).append(callback)
        callback(grpc.ChannelConnectivity.READY if self.get(name) else grpc.ChannelConnectivity.CONNECTING)

    def unwatch(self, name: str, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        with self._lock:
            callbacks = self._watchers.get(name, [])
            if callback in callbacks:
                callbacks.remove(callback)

    def _notify(self, name: str, state: grpc.ChannelConnectivity) -> None:
        with self._lock:
            callbacks = list(self._watchers.get(name, []))
        for callback in callbacks:
            callback(state)


# ------------------------------------------------------------------------------------------ channel


class TunnelChannel(grpc.Channel):
    """A ``grpc.Channel`` to the worker behind the tunnel named ``name``: each call opens one through
    whichever tunnel that worker has open at the time (UNAVAILABLE while it has none)."""

    def __init__(self, tunnels: Tunnels, name: str) -> None:
        self.tunnels, self.name = tunnels, name
        self._subscribed: list[Callable[[grpc.ChannelConnectivity], None]] = []

    def _multi(
        self, method: str, streams: bool, request_serializer: Callable | None, response_deserializer: Callable | None
    ) -> _MultiCallable:
        return _MultiCallable(self, method, streams, request_serializer or identity, response_deserializer or identity)

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable | None = None,
        response_deserializer: Callable | None = None,
        _registered_method: bool = False,
    ) -> _MultiCallable:
        return self._multi(method, False, request_serializer, response_deserializer)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable | None = None,
        response_deserializer: Callable | None = None,
        _registered_method: bool = False,
    ) -> _MultiCallable:
        return self._multi(method, True, request_serializer, response_deserializer)

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable | None = None,
        response_deserializer: Callable | None = None,
        _registered_method: bool = False,
    ) -> _MultiCallable:
        return self._multi(method, False, request_serializer, response_deserializer)

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable | None = None,
        response_deserializer: Callable | None = None,
        _registered_method: bool = False,
    ) -> _MultiCallable:
        return self._multi(method, True, request_serializer, response_deserializer)

    def subscribe(self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False) -> None:
        self._subscribed.append(callback)
        self.tunnels.watch(self.name, callback)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        if callback in self._subscribed:
            self._subscribed.remove(callback)
        self.tunnels.unwatch(self.name, callback)

    def close(self) -> None:
        for callback in list(self._subscribed):
            self.unsubscribe(callback)

    def __enter__(self) -> TunnelChannel:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


class _MultiCallable:
    """One method through a tunnel; called as grpc's multi-callables are (``request``, ``timeout``,
    ``metadata``). A request iterator (streaming methods) is sent from a thread of its own, as grpc does."""

    def __init__(
        self, channel: TunnelChannel, method: str, streams_responses: bool, serialize: Callable, deserialize: Callable
    ) -> None:
        self.channel, self.method, self.streams_responses = channel, method, streams_responses
        self.serialize, self.deserialize = serialize, deserialize

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None, **_ignored: Any) -> Any:
        call = self._start(request, timeout, metadata)
        return _Responses(call, self.deserialize) if self.streams_responses else self._reply(call)

    def future(self, request: Any, timeout: float | None = None, metadata: Any = None, **_ignored: Any) -> _Future:
        """A unary-reply call in flight: ``result()`` waits for the reply, ``cancel()`` abandons it."""
        return _Future(self._start(request, timeout, metadata), lambda call: self._reply(call))

    def _start(self, request: Any, timeout: float | None, metadata: Any) -> _Call:
        link = self.channel.tunnels.get(self.channel.name)
        if link is None:
            raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"{TUNNEL_PREFIX}{self.channel.name} has no tunnel open")
        if timeout is None or not math.isfinite(timeout) or timeout <= 0:
            raise TunnelError(grpc.StatusCode.INVALID_ARGUMENT, "calls through a tunnel need a deadline")
        call = link.open_call(self.method, timeout, [(str(k), str(v)) for k, v in (metadata or ())])
        if hasattr(request, "SerializeToString") or isinstance(request, bytes):
            self._send_all(call, [request])
        else:
            threading.Thread(
                target=self._send_all, args=(call, request), name="gradwire-tunnel-send", daemon=True
            ).start()
        return call

    def _reply(self, call: _Call) -> Any:
        message = call.receive()
        if message is None:
            raise TunnelError(grpc.StatusCode.INTERNAL, "the worker ended a unary call without a reply")
        reply = self.deserialize(message)
        if call.receive() is not None:
            raise TunnelError(grpc.StatusCode.INTERNAL, "the worker sent two replies to a unary call")
        return reply

    def _send_all(self, call: _Call, requests: Any) -> None:
        try:
            for request in requests:
                call.send(message=self.serialize(request))
            call.send(half_close=True)
        except TunnelError:
            pass  # the call ended (cancelled, deadline, tunnel closed): its receiver says so
        except Exception as e:  # noqa: BLE001 - the caller's request iterator failed: end the call, as grpc does
            log.warning("request stream through the tunnel failed: %s", e)
            call.cancel()


class _Future:
    """A unary-reply call through a tunnel, as ``grpc.Future``: ``result``, ``cancel``."""

    def __init__(self, call: _Call, reply: Callable[[_Call], Any]) -> None:
        self._call, self._reply = call, reply
        self._cancelled = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._reply(self._call)
        except TunnelError as e:
            if self._cancelled and e.code() is grpc.StatusCode.CANCELLED:
                raise grpc.FutureCancelledError from None
            raise

    def cancel(self) -> bool:
        self._cancelled = True
        self._call.cancel()
        return True


class _Responses:
    """The response stream of a call through a tunnel: iterate it; ``cancel`` from any thread."""

    def __init__(self, call: _Call, deserialize: Callable) -> None:
        self._call, self._deserialize = call, deserialize
        self._code: grpc.StatusCode | None = None

    def __iter__(self) -> _Responses:
        return self

    def __next__(self) -> Any:
        try:
            message = self._call.receive()
        except TunnelError as e:
            self._code = e.code()
            raise
        if message is None:
            self._code = grpc.StatusCode.OK
            raise StopIteration
        return self._deserialize(message)

    def cancel(self) -> bool:
        self._call.cancel()
        return True

    def code(self) -> grpc.StatusCode | None:
        return self._code
