"""What both ends of a tunnel agree on (``Coordinator.Tunnel`` in coordinator.proto): which methods may
travel through one and how, the limits, and the checks of a frame's fields.

A worker behind NAT opens the tunnel (``worker.tunnel``); the coordinator calls it through the tunnel as
if through a channel (``coordinator.tunnel``). The methods are read from the protos, so a method added to
the Worker service travels through tunnels with no edit here.
"""

from __future__ import annotations

import queue
import re
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from gradwire.v1 import worker_pb2

TUNNEL_PREFIX = "tunnel:"  # a tunnelled worker's member address is TUNNEL_PREFIX + its name
MAX_NAME_CHARS = 128
MAX_DETAILS_CHARS = 1000
MAX_CALLS = 16  # calls in flight through one tunnel (the coordinator makes one or two at a time)
MAX_METADATA = 16  # entries per call
MAX_METADATA_CHARS = 8192  # in all, per call
QUEUED_MESSAGES = 8  # per call and direction: at most this many 2 MiB parts wait; the sender then waits
TUNNEL_SECONDS = 24 * 3600.0  # a tunnel's own deadline; the worker opens a new one when it ends


def _methods() -> dict[str, tuple[bool, bool]]:
    """Full method name -> (streams requests, streams responses), for the Worker service and health Check."""
    table = {}
    for service in (worker_pb2.DESCRIPTOR.services_by_name["Worker"], health_pb2.DESCRIPTOR.services_by_name["Health"]):
        for method in service.methods:
            if service.name == "Health" and method.name != "Check":
                continue  # Watch is a call that never ends: not through a tunnel
            table[f"/{service.full_name}/{method.name}"] = (method.client_streaming, method.server_streaming)
    return table


METHODS = _methods()

_NAME = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_NAME_CHARS)
_KEY = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_VALUE = re.compile(r"[\x20-\x7e]*")


def check_name(name: str) -> str:
    """A tunnel's name: 1-128 printable characters without spaces; ``ValueError`` saying why if not."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"a tunnel's name must be 1-{MAX_NAME_CHARS} printable characters without spaces, got "
            f"{name[:40]!r}{'...' if len(name) > 40 else ''}"
        )
    return name


def check_metadata(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Metadata a call carries through a tunnel: at most 16 ASCII entries, 8 KiB in all, no grpc-reserved
    or binary keys; ``ValueError`` saying which entry if not."""
    if len(pairs) > MAX_METADATA:
        raise ValueError(f"{len(pairs)} metadata entries; at most {MAX_METADATA}")
    if sum(len(k) + len(v) for k, v in pairs) > MAX_METADATA_CHARS:
        raise ValueError(f"metadata over {MAX_METADATA_CHARS} characters")
    for key, value in pairs:
        if (
            not _KEY.fullmatch(key)
            or key.startswith("grpc-")
            or key.endswith("-bin")
            or key in ("content-type", "te", "user-agent")
        ):
            raise ValueError(f"metadata key {key[:64]!r} cannot travel through a tunnel")
        if not _VALUE.fullmatch(value):
            raise ValueError(f"metadata {key!r}: the value must be printable ASCII")
    return pairs


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a number on the wire; UNKNOWN for one that is not a status code."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def identity(x: Any) -> Any:
    """The (de)serializer of a call whose messages travel as the bytes they already are."""
    return x


def put_while(q: queue.Queue, item: Any, alive: Callable[[], bool], poll: float = 0.25) -> bool:
    """Put ``item`` into the bounded ``q``, waiting for room as long as ``alive()``; whether it went in."""
    while alive():
        try:
            q.put(item, timeout=poll)
            return True
        except queue.Full:
            continue
    return False
