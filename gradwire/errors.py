"""What a failed call ends with: the service's errors and the one mapping from an error to a gRPC status.

Both sides use it: the worker's servicer answers with ``status_for``, and the in-process link
(``worker.inprocess``) raises the same ``WorkerError`` the gRPC client would, so the round loop sees one
kind of failure whichever link carried the call.
"""

from __future__ import annotations

import grpc

from gradwire.compression import NonFiniteInput

MAX_DETAILS = 1000  # an error's text travels as call metadata: keep it well under grpc's limits


class Cancelled(Exception):
    """The caller went away (cancelled call, deadline, shutdown): the round's work is abandoned."""


class AccessDenied(PermissionError):
    """The caller does not own the run it names (``gradwire.security.run_owner``)."""


class NotHeld(LookupError):
    """What a sound call asks for is not, or no longer, held here: a gossip message of a round this worker
    no longer keeps, its public copy at a round it is not at, a neighbour's message it could not pull. The
    caller's view has moved on; its request is not wrong."""


class PeersUnreachable(NotHeld):
    """Peer-to-peer gossip: the messages of these neighbours could not be pulled from them (``members``); or,
    in a relayed star round, a payload came from none of these sources. The round answers it as a status
    (``RoundResult.unreachable_peers``), so that the coordinator relays them."""

    def __init__(self, message: str, members: tuple[str, ...]) -> None:
        super().__init__(message)
        self.members = members


class TooLarge(ValueError):
    """A sound request this worker cannot hold: the run's state would not fit its memory (the message
    names the sizes). A ``ValueError``, so that every rank refuses it alike, but not the caller's mistake."""


def status_for(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a failed call ends with, and its text; ``None`` for a bug (INTERNAL). Pure."""
    text = str(e) if len(str(e)) <= MAX_DETAILS else str(e)[:MAX_DETAILS] + "..."
    if isinstance(e, Cancelled):
        return grpc.StatusCode.CANCELLED, text
    if isinstance(e, AccessDenied):
        return grpc.StatusCode.PERMISSION_DENIED, text
    if isinstance(e, TooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, text
    if isinstance(e, ValueError):  # the request itself is wrong
        return grpc.StatusCode.INVALID_ARGUMENT, text
    if isinstance(e, NotHeld):
        return grpc.StatusCode.FAILED_PRECONDITION, text
    if isinstance(e, NonFiniteInput):  # a sound request, but the run has diverged on this worker
        return grpc.StatusCode.FAILED_PRECONDITION, text
    return None
