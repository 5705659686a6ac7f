"""Transport settings both ends of a gRPC channel share: message limits and keepalive.

Large messages travel as ``protocol.PART_BYTES`` (2 MiB) parts, so one gRPC message never needs more than
``GRPC_MESSAGE_MB``; ``--max-message-mb`` caps the *assembled* message (a model state, a work order).
"""

from __future__ import annotations

import socket

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for local workers, a node's rendezvous, tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
