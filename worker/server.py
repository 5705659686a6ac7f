"""The worker's one gRPC server factory and its lifecycle: limits, keepalive, deadlines, token, TLS,
health, shutdown.

``make_server`` is the only place a worker's ``grpc.Server`` is built, so every server (the CLI's, the
tests', a node group's) gets the same message limits, keepalive policy, deadline rule, token check, TLS
and health service (``gradwire.interceptors``, ``gradwire.security``).
``serve`` runs one until SIGTERM/SIGINT: health turns NOT_SERVING first (so load balancers and coordinators
stop sending work), then in-flight calls get ``grace`` seconds before they are cancelled.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradwire.interceptors import RejectMalformed, RequireDeadline, RequireToken
from gradwire.security import ClientSecurity, ServerSecurity
from gradwire.transport import DEFAULT_MESSAGE_MB, SERVICE_NAME, check_message_mb, grpc_options
from gradwire.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------------------------- factory


def make_server(
    servicer: Any,
    *,
    host: str = "[::]",
    port: int = 0,
    max_workers: int = 8,
    security: ServerSecurity | None = None,
    add: Callable[[Any, grpc.Server], None] = worker_pb2_grpc.add_WorkerServicer_to_server,
    service_name: str = SERVICE_NAME,
    local_socket: str | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build and start a server for ``servicer`` (a Worker by default; ``add`` registers another service,
    as the coordinator's Join service does); return it, the bound port (useful with ``port=0``) and its
    health. ``local_socket``: also listen on this Unix socket, in plaintext (for the tunnel relay, which
    runs in this process; the same interceptors apply to it).

    Health reports SERVING for "" and ``service_name`` once the server has started; it needs no token.
    Raises ``OSError`` if the address cannot be bound, ``ValueError`` if a TLS file cannot be read.
    """
    security = security or ServerSecurity()
    credentials = security.credentials()  # before anything binds: a bad file fails the start
    interceptors: list[grpc.ServerInterceptor] = [RequireDeadline(), RejectMalformed()]
    if security.token is not None:
        interceptors.insert(0, RequireToken(security.token))  # strangers learn nothing, not even the deadline rule
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gradwire-worker"),
        interceptors=interceptors,
        options=_server_options(),
    )
    add(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0:  # grpc raises RuntimeError, or in older versions returns 0
        raise OSError(
            f"cannot listen on {host}:{port}: the port is in use or the address is not this machine's (--host, --port)"
        )
    if local_socket is not None:
        server.add_insecure_port(f"unix:{local_socket}")
    server.start()
    for service in ("", service_name):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def serve(
    engine: Any,
    host: str = "[::]",
    port: int = 0,
    max_message_mb: int = DEFAULT_MESSAGE_MB,
    grace: float = 5.0,
    security: ServerSecurity | None = None,
    join: str | None = None,
    advertise: str | None = None,
    tunnel: bool = False,
    join_security: ClientSecurity | None = None,
) -> int:
    """Serve ``engine`` until SIGTERM or SIGINT, then shut down gracefully; return the exit code: 0, or 1
    when a node lost a rank (its launcher, or torchrun, then restarts the node).

    ``join``: announce this worker to the coordinator there (``--join``), or with ``tunnel`` hold a tunnel
    open to it and serve its calls through that (``--tunnel``: for a worker behind NAT); ``join_security``
    says how to reach it (token, TLS).

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
    security = security or ServerSecurity()
    relay_dir = tempfile.mkdtemp(prefix="gradwire-relay-") if join and tunnel else None  # private (0700)
    relay_socket = f"{relay_dir}/worker.sock" if relay_dir else None
    server, bound, health_servicer = make_server(
        servicer, host=host, port=port, security=security, local_socket=relay_socket
    )
    log.info(
        "worker listening on %s:%d (%s, %s)",
        host,
        bound,
        "TLS" + (" with client certificates" if security.tls_client_ca else "") if security.tls else "plaintext",
        "token required" if security.token else "no token",
    )
    for warning in security.warnings(host):
        log.warning("!" * 100)
        log.warning("%s", warning)
        log.warning("!" * 100)
    joiner: Any = None
    if join:  # announce ourselves to a coordinator (--join), or hold a tunnel open to it (--tunnel)
        from gradwire.worker.joiner import Joiner, advertised_address

        name = advertised_address(host, bound, advertise)
        join_security = join_security or ClientSecurity(token=security.token)
        if relay_socket is not None:
            from gradwire.worker.tunnel import TunnelRelay

            joiner = TunnelRelay(join, name, f"unix:{relay_socket}", security=join_security).start()
        else:
            joiner = Joiner(join, name, security=join_security).start()

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
        if joiner is not None:
            joiner.stop()
        health_servicer.enter_graceful_shutdown()  # every service NOT_SERVING, and it stays that way
        stopped = server.stop(grace)
        while not stopped.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if relay_dir is not None:
            shutil.rmtree(relay_dir, ignore_errors=True)
    if node_failed.is_set():
        log.error("worker stopped: the node lost a rank")
        return 1
    stop_node = getattr(engine, "stop_node", None)
    if callable(stop_node):
        stop_node()  # the node's other ranks leave their loop
    log.info("worker stopped")
    return 0
