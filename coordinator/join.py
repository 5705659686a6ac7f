"""``coordinator train --listen PORT``: workers join the run by calling the coordinator.

``JoinRegistry`` is the core: addresses with the time each was last heard of, thread-safe, with ``poll``
(the live addresses, oldest joiner first, when they changed) and ``forget`` as the trainer's member
source - the same interface as ``--workers-file``. An address not heard of for ``expiry`` seconds leaves
(a worker repeats Join every ``rejoin`` seconds, so only a dead or unreachable one goes quiet). A worker
behind NAT opens a tunnel instead (``coordinator.tunnel``): it is a member as "tunnel:NAME" while its
tunnel is open (``hold``), and for ``expiry`` seconds after it drops (``release``), so a brief reconnect
costs no state push.
``CoordinatorServicer`` is thin over both; ``serve_joins`` starts the server (the worker's server
factory: token, deadlines, malformed requests, health).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from gradwire.coordinator.membership import parse_addresses
from gradwire.coordinator.tunnel import MAX_TUNNELS, Tunnels
from gradwire.protocol import PROTOCOL_VERSION
from gradwire.security import ServerSecurity
from gradwire.tunnel import TUNNEL_PREFIX
from gradwire.v1 import coordinator_pb2 as pb
from gradwire.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "gradwire.v1.Coordinator"
REJOIN_SECONDS = 5.0
EXPIRY_SECONDS = 30.0
MAX_MEMBERS = 1024


class JoinRegistry:
    """The workers that have joined, by address, with when each was last heard of."""

    def __init__(self, expiry: float = EXPIRY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.expiry = expiry
        self._clock = clock
        self._seen: dict[str, float] = {}  # insertion order = join order
        self._held: set[str] = set()  # live whatever the clock says: their tunnels are open
        self._lock = threading.Lock()
        self._last: list[str] | None = None
        self._changed = threading.Condition(self._lock)

    def join(self, address: str) -> tuple[bool, str]:
        """Record ``address`` (host:port) as alive now; (accepted, why not)."""
        try:
            (address,) = parse_addresses(address)
        except ValueError as e:
            return False, str(e)
        return self._seen_now(address)

    def hold(self, address: str) -> tuple[bool, str]:
        """``address`` is live until ``release`` (its tunnel is open); (accepted, why not)."""
        accepted, reason = self._seen_now(address)
        if accepted:
            with self._lock:
                self._held.add(address)
        return accepted, reason

    def release(self, address: str) -> None:
        """``address`` (held) stays live for ``expiry`` seconds from now, unless held again."""
        with self._lock:
            self._held.discard(address)
            if address in self._seen:
                self._seen[address] = self._clock()

    def _seen_now(self, address: str) -> tuple[bool, str]:
        with self._lock:
            if address not in self._seen and len(self._seen) >= MAX_MEMBERS:
                return False, f"the run has {MAX_MEMBERS} workers already"
            new = address not in self._seen
            self._seen[address] = self._clock()
            if new:
                log.info("%s joined", address)
                self._changed.notify_all()
        return True, ""

    def live(self) -> list[str]:
        """The addresses heard of within ``expiry``, oldest joiner first (the expired ones are dropped)."""
        with self._lock:
            now = self._clock()
            for address in [a for a, t in self._seen.items() if now - t > self.expiry and a not in self._held]:
                log.info("%s left (not heard of for %.0f s)", address, now - self._seen.pop(address))
            return list(self._seen)

    def wait_for(self, count: int, timeout: float) -> list[str]:
        """Block until ``count`` workers have joined (or ``timeout``); the live addresses then."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._seen) < count and time.monotonic() < deadline:
                self._changed.wait(min(1.0, deadline - time.monotonic()))
        return self.live()

    def poll(self) -> list[str] | None:
        """The live addresses if they changed since the last poll, else ``None``."""
        live = self.live()
        if live == self._last:
            return None
        self._last = live
        return live

    def forget(self) -> None:
        self._last = None


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, registry: JoinRegistry, tunnels: Tunnels | None = None) -> None:
        self.registry = registry
        self.tunnels = tunnels or Tunnels()
        self.tunnels.on_open = lambda name: registry.hold(TUNNEL_PREFIX + name)
        self.tunnels.on_close = lambda name: registry.release(TUNNEL_PREFIX + name)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        if request.protocol_version != PROTOCOL_VERSION:
            reason = (
                f"this coordinator speaks protocol {PROTOCOL_VERSION}, "
                f"the worker {request.protocol_version}: upgrade the older one"
            )
            return pb.JoinReply(protocol_version=PROTOCOL_VERSION, accepted=False, reason=reason)
        accepted, reason = self.registry.join(request.address[:300])
        if not accepted:
            log.warning("join from %s refused: %s", context.peer(), reason)
        return pb.JoinReply(
            protocol_version=PROTOCOL_VERSION, accepted=accepted, reason=reason, rejoin_seconds=REJOIN_SECONDS
        )

    def Tunnel(
        self, request_iterator: Iterator[pb.TunnelFrame], context: grpc.ServicerContext
    ) -> Iterator[pb.TunnelFrame]:
        return self.tunnels.serve(request_iterator, context)


def serve_joins(
    registry: JoinRegistry,
    *,
    host: str,
    port: int,
    security: ServerSecurity | None = None,
    tunnels: Tunnels | None = None,
) -> tuple[grpc.Server, int]:
    """Start the Coordinator service on ``host:port``; return the server and the bound port. ``tunnels``
    receives the workers' tunnels (a new registry of them if not given)."""
    from gradwire.server import make_server  # the one server factory (limits, token, deadlines, health)

    server, bound, _ = make_server(
        # every open tunnel holds a server thread for its life, besides the few for Join calls
        CoordinatorServicer(registry, tunnels),
        host=host,
        port=port,
        max_workers=4 + MAX_TUNNELS,
        security=security,
        add=coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
        service_name=SERVICE_NAME,
    )
    return server, bound
