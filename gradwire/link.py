"""A worker link: the one interface the round loop calls a worker through, and how a call fails.

``WorkerLink`` is satisfied by the gRPC client (``coordinator.client.WorkerClient``, also over a worker's
tunnel, which is only another channel for it) and by the in-process link (``worker.inprocess``) that
simulations use. The calls that move data return what they moved (``Traffic``) beside their answer, so a
link holds no per-call state and one link may serve several threads' calls in turn.
Every failure is a ``WorkerError`` carrying a ``grpc.StatusCode``: the round loop treats it as that
worker's state for one round, never as a crash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import grpc

from gradwire.compression import CompressedGradient
from gradwire.protocol import GossipPieceRequest, ModelState, RoundResult, WorkerInfo, WorkerState, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.v1 import worker_pb2 as pb

OnPiece = Callable[[CompressedGradient], None]  # takes each piece of a streamed gradient as it arrives


class WorkerError(Exception):
    """A call to one worker failed; ``code`` is a ``grpc.StatusCode`` saying how.

    Besides the worker's own statuses: UNAVAILABLE (unreachable or not serving), DEADLINE_EXCEEDED
    (straggler), FAILED_PRECONDITION (another protocol version, or training diverged on that worker),
    DATA_LOSS (a reply that does not parse).
    """

    def __init__(self, address: str, code: grpc.StatusCode, details: str, message: str | None = None) -> None:
        super().__init__(message or f"worker at {address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The bytes one call moved: ``down`` coordinator to worker, ``up`` worker to coordinator."""

    down: int = 0
    up: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.down + other.down, self.up + other.up)


class WorkerLink(Protocol):
    """How the coordinator reaches one worker. ``timeout`` is each call's deadline in seconds."""

    address: str

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker serves; ``WorkerError`` (UNAVAILABLE) if it does not in time."""

    def describe(self, timeout: float | None = None) -> WorkerInfo:
        """The worker's versions and device; ``WorkerError`` if it speaks another protocol."""

    def push_state(self, state: ModelState, timeout: float | None = None) -> tuple[tuple[int, Fingerprint], Traffic]:
        """Replace the worker's replica of ``state.run_id``: its version and fingerprint, and the bytes."""

    def run_round(
        self, order: WorkOrder, timeout: float | None = None, on_piece: OnPiece | None = None
    ) -> tuple[RoundResult, Traffic]:
        """One round: the worker's result, and the bytes both ways. A streamed gradient's pieces
        (``WorkOrder.stream_buckets``) go to ``on_piece`` as they arrive, and the result's gradient holds
        no tensors then; an error ``on_piece`` raises ends the call with it."""

    def fetch_worker_state(self, run_id: str, timeout: float | None = None) -> tuple[WorkerState, Traffic]:
        """The worker's error feedback and inner optimizer state of ``run_id`` (for checkpoints)."""

    def pull_gossip(self, request: GossipPieceRequest, timeout: float | None = None) -> tuple[pb.GossipPiece, Traffic]:
        """A peer-to-peer gossip worker's message or public copy (``Worker.PullGossip``), and the bytes."""

    def close_run(self, run_id: str, timeout: float | None = None) -> bool:
        """Ask the worker to drop its session of ``run_id``; whether it held one."""

    def cancel(self) -> None:
        """Cancel the call in flight, if any (from another thread): it fails with CANCELLED."""

    def close(self) -> None:
        """Release the link (its channel); the worker itself keeps running."""
