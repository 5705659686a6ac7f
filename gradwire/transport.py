"""Transport settings both ends of a gRPC channel share: message limits and keepalive.

Large messages travel as ``protocol.PART_BYTES`` (2 MiB) parts, so one gRPC message never needs more than
``GRPC_MESSAGE_MB``; ``--max-message-mb`` caps the *assembled* message (a model state, a work order).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

SERVICE_NAME = "gradwire.v1.Worker"

GRPC_MESSAGE_MB = 16
MIN_MESSAGE_MB = 4
DEFAULT_MESSAGE_MB = 16384  # a ~4B-parameter fp32 state


def check_message_mb(max_message_mb: int) -> int:
    if max_message_mb < MIN_MESSAGE_MB:
        raise ValueError(f"--max-message-mb must be >= {MIN_MESSAGE_MB}, got {max_message_mb}")
    return max_message_mb


def grpc_options() -> list[tuple[str, int]]:
    """Channel arguments both ends use: message limits and keepalive (the client adds its own on top)."""
    limit = GRPC_MESSAGE_MB << 20
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # Far-apart workers sit behind NATs and proxies that drop idle TCP connections: ping every 30 s,
        # give up on a peer that does not answer within 10 s, and do so between calls too.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


_handed_out: set[int] = set()  # this process's answers: two calls before either port is bound differ


def free_port(host: str = "127.0.0.1", *, ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port nothing listens on right now (for local workers, a node's rendezvous, tests).

    The port is taken *below* the kernel's ephemeral range: a port from there (``bind(0)``) can be handed
    to any outgoing connection (a node's gloo pairs, a gRPC client) in the seconds before its server binds
    it, and then the server cannot start. Falls back to ``bind(0)`` when there is no room below the range."""
    low, _ = ephemeral or ephemeral_ports()
    first = 10_000
    if low - first >= 1_000:
        for _ in range(200):
            port = random.randrange(first, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
