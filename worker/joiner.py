"""``worker serve --join HOST:PORT``: announce this worker to a coordinator, again and again.

A background thread calls the coordinator's Join with the address it should dial (``--advertise``, or
this worker's own host:port) every few seconds until the worker stops, so a restarted worker or
coordinator finds its place again. Failures are logged once per kind, never fatal: the worker keeps
serving whoever calls it.
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc

from gradwire.protocol import PROTOCOL_VERSION
from gradwire.security import ClientSecurity
from gradwire.transport import grpc_options
from gradwire.v1 import coordinator_pb2 as pb
from gradwire.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """What to tell the coordinator: ``--advertise``, else this worker's host (its name when it listens on
    every interface) and port."""
    if advertise:
        return advertise
    name = host.strip("[]")
    if name in ("", "::", "0.0.0.0"):  # noqa: S104 - reading the setting, not binding
        name = socket.getfqdn()
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


class Joiner:
    """Calls Join on ``coordinator`` every ``every`` seconds (or as the reply says) until ``stop``."""

    def __init__(
        self,
        coordinator: str,
        address: str,
        *,
        token: str | None = None,
        security: ClientSecurity | None = None,
        every: float = 5.0,
        timeout: float = 10.0,
    ) -> None:
        self.coordinator, self.address, self.every, self.timeout = coordinator, address, every, timeout
        security = security or ClientSecurity(token=token)  # ``security``: TLS to the coordinator too
        self._metadata = security.metadata(run_key=False)
        self._channel = security.channel(coordinator, grpc_options())
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gradwire-join", daemon=True)
        self.joins = 0  # accepted Join calls so far
        self._last_error = ""

    def start(self) -> Joiner:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout + 1)
        self._channel.close()

    def join_once(self) -> float:
        """One Join call; the seconds until the next."""
        try:
            reply = self._stub.Join(
                pb.JoinRequest(protocol_version=PROTOCOL_VERSION, address=self.address),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            self._note(f"cannot reach the coordinator at {self.coordinator}: {e.code().name}: {e.details()}")
            return self.every
        if not reply.accepted:
            self._note(f"the coordinator at {self.coordinator} refused {self.address}: {reply.reason}")
            return self.every
        if self.joins == 0 or self._last_error:
            log.info("joined the coordinator at %s as %s", self.coordinator, self.address)
        self.joins += 1
        self._last_error = ""
        return reply.rejoin_seconds or self.every

    def _note(self, error: str) -> None:
        if error != self._last_error:
            log.warning("%s; trying again every %.0f s", error, self.every)
        self._last_error = error

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(self.join_once())
