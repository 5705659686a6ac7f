"""The one gRPC server factory of both sides: limits, keepalive, deadlines, token, TLS, health.

``make_server`` is the only place a ``grpc.Server`` is built, so every server (a worker's, a node
group's, the coordinator's Join service, the tests') gets the same message limits, keepalive policy,
deadline rule, token check, TLS and health service (``gradwire.interceptors``, ``gradwire.security``).
It lives here, not under ``worker/``, because the coordinator serves too (``--listen``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradwire.interceptors import RejectMalformed, RequireDeadline, RequireToken
from gradwire.security import ServerSecurity
from gradwire.transport import SERVICE_NAME, grpc_options
from gradwire.v1 import worker_pb2_grpc


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
