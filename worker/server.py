"""A worker's server lifecycle: serve until a signal, then shut down gracefully.

The server itself comes from ``gradwire.server.make_server``, the one factory of both sides.
``serve`` runs one until SIGTERM/SIGINT: health turns NOT_SERVING first (so load balancers and coordinators
stop sending work), then in-flight calls get ``grace`` seconds before they are cancelled.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
from typing import Any

from gradwire.security import ClientSecurity, ServerSecurity
from gradwire.server import make_server
from gradwire.transport import DEFAULT_MESSAGE_MB, check_message_mb

__all__ = ["make_server", "serve"]

log = logging.getLogger(__name__)


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
    peer_security: ClientSecurity | None = None,
) -> int:
    """Serve ``engine`` until SIGTERM or SIGINT, then shut down gracefully; return the exit code: 0, or 1
    when a node lost a rank (its launcher, or torchrun, then restarts the node).

    ``join``: announce this worker to the coordinator there (``--join``), or with ``tunnel`` hold a tunnel
    open to it and serve its calls through that (``--tunnel``: for a worker behind NAT); ``join_security``
    says how to reach it (token, TLS). ``peer_security``: how peer-to-peer gossip pulls from the neighbours
    (default: this worker's token, TLS if it serves TLS).

    Must run on the main thread (signal handlers can only be installed there). A second signal during the
    grace period stops the server at once.
    """
    from gradwire.worker.peers import Peers
    from gradwire.worker.servicer import WorkerServicer  # here: the servicer pulls in torch via the engine

    stop = threading.Event()
    node_failed = threading.Event()

    def on_node_failure() -> None:
        node_failed.set()
        stop.set()

    engine.on_node_failure = on_node_failure  # from a failed call or a failed heartbeat alike
    security = security or ServerSecurity()
    if hasattr(engine, "peers"):
        engine.peers = Peers(
            peer_security or ClientSecurity(token=security.token, tls=security.tls),
            max_message_mb=check_message_mb(max_message_mb),
        )
    servicer = WorkerServicer(engine, max_message_mb=check_message_mb(max_message_mb))
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
