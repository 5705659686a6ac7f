"""The worker's one gRPC server factory and its lifecycle: limits, keepalive, deadlines, health, shutdown.

``make_server`` is the only place a worker's ``grpc.Server`` is built, so every server (the CLI's, the
tests', a node group's) gets the same message limits, keepalive policy, deadline rule and health service.
``serve`` runs one until SIGTERM/SIGINT: health turns NOT_SERVING first (so load balancers and coordinators
stop sending work), then in-flight calls get ``grace`` seconds before they are cancelled.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradwire.transport import DEFAULT_MESSAGE_MB, SERVICE_NAME, check_message_mb, grpc_options
from gradwire.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

_EXEMPT_PREFIX = "/grpc.health.v1.Health/"
# Without a deadline grpc reports the time left as ~9.2e18 s (not None); beyond a year means "none".
_NO_DEADLINE_SECONDS = 365 * 24 * 3600.0

def _server_options() -> list[tuple[str, int]]:
    # A server by default treats pings more often than every 5 minutes on an idle connection as abuse and
    # answers GOAWAY "too_many_pings"; accept the clients' 30 s keepalive (with headroom for jitter).
    return [
        *grpc_options(),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # grpc sets SO_REUSEPORT by default: a second worker on a busy port would start "fine" and take
        # half of the first one's connections. Fail to bind instead.
        ("grpc.so_reuseport", 0),
    ]


# ------------------------------------------------------------------------------------------- deadlines


def has_deadline(context: grpc.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining < _NO_DEADLINE_SECONDS


class RequireDeadline(grpc.ServerInterceptor):
    """Rejects every call that carries no deadline (INVALID_ARGUMENT); health checks are exempt.

    A call without a deadline can hold a worker thread forever when its client hangs. The interceptor
    cannot see the call's context, so it wraps the handler and checks at the top of each call.
    """

    MESSAGE = "every call needs a deadline"

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(_EXEMPT_PREFIX):
            return handler
        return _with_deadline_check(handler)


def _with_deadline_check(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def checked(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if not has_deadline(context):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, RequireDeadline.MESSAGE)
            return behavior(request, context)

        return call

    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    }
    make, behavior = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(checked(behavior), request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


# ------------------------------------------------------------------------------------------- factory


def make_server(servicer: worker_pb2_grpc.WorkerServicer, *, host: str = "[::]", port: int = 0, max_workers: int = 8) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build and start a worker server; return it, the bound port (useful with ``port=0``) and its health.

    Health reports SERVING for "" and the Worker service once the server has started. Raises ``OSError``
    if the address cannot be bound.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gradwire-worker"),
        interceptors=[RequireDeadline()],
        options=_server_options(),
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:  # grpc raises RuntimeError, or in older versions returns 0
        raise OSError(f"cannot listen on {host}:{port}: the port is in use or the address is not this machine's (--host, --port)")
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def serve(engine: Any, host: str = "[::]", port: int = 0, max_message_mb: int = DEFAULT_MESSAGE_MB, grace: float = 5.0) -> int:
    """Serve ``engine`` until SIGTERM or SIGINT, then shut down gracefully; return the exit code: 0, or 1
    when a node lost a rank (its launcher, or torchrun, then restarts the node).

    Must run on the main thread (signal handlers can only be installed there). A second signal during the
    grace period stops the server at once.
    """
    from gradwire.worker.servicer import WorkerServicer  # here: the servicer pulls in torch via the engine

    stop = threading.Event()
    node_failed = threading.Event()

    def on_node_failure() -> None:
        node_failed.set()
        stop.set()

    engine.on_node_failure = on_node_failure  # from a failed call or a failed heartbeat alike
    servicer = WorkerServicer(engine, max_message_mb=check_message_mb(max_message_mb))
    server, bound, health_servicer = make_server(servicer, host=host, port=port)
    log.info("worker listening on %s:%d", host, bound)

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            log.warning("%s again: stopping now", signal.Signals(signum).name)
            server.stop(0)
            return
        log.info("%s: not serving; finishing in-flight calls (grace %.1f s)", signal.Signals(signum).name, grace)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # A timed wait, so the main thread wakes up to run signal handlers.
        while not stop.wait(0.5):
            pass
        health_servicer.enter_graceful_shutdown()  # every service NOT_SERVING, and it stays that way
        stopped = server.stop(grace)
        while not stopped.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if node_failed.is_set():
        log.error("worker stopped: the node lost a rank")
        return 1
    stop_node = getattr(engine, "stop_node", None)
    if callable(stop_node):
        stop_node()  # the node's other ranks leave their loop
    log.info("worker stopped")
    return 0
