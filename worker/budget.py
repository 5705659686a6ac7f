"""How many bytes the state pushes in flight on a worker may hold together, whoever sends them.

A push allocates a replica's parameters as their bytes arrive (``Replica.load_tensor``), so one caller makes
a worker allocate no more than it has sent. Many callers at once could still add up: every push in flight
takes what it allocates from one ``PushBudget``, and gives it back when it ends (its session is then the
run's, or is dropped). On a single device or a DDP node that is each tensor's bytes as it arrives. On a
split node (fsdp, pipeline), whose ranks allocate their shards or stage when the push starts, it is a
rank's share of the model up front, and each tensor's bytes only while it is being loaded.

A push that would overdraw the budget is refused with the sizes (``TooLarge``: RESOURCE_EXHAUSTED, worth
retrying once the others are done) and keeps nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from gradwire.errors import TooLarge


class PushBudget:
    """``limit`` bytes shared by the pushes in flight; thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a push budget must be positive, got {limit}")
        self.limit = limit
        self.held = 0  # bytes the pushes in flight hold now
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def push(self) -> Iterator[PushTicket]:
        """One push's share: what it ``take``s is given back when the block ends, however it ends."""
        ticket = PushTicket(self)
        try:
            yield ticket
        finally:
            self._give_back(ticket.held)
            ticket.held = 0

    def _take(self, n: int) -> None:
        with self._lock:
            if self.held + n > self.limit:
                raise TooLarge(
                    f"the state pushes in flight on this worker would hold {(self.held + n) / 2**20:,.1f} MiB, "
                    f"more than its push budget of {self.limit / 2**20:,.1f} MiB (worker serve "
                    "--push-budget-gb); retry once the others are done"
                )
            self.held += n

    def _give_back(self, n: int) -> None:
        with self._lock:
            self.held -= n


class PushTicket:
    """What one push holds of a ``PushBudget``."""

    def __init__(self, budget: PushBudget) -> None:
        self._budget = budget
        self.held = 0

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes, or raise ``TooLarge`` (holding nothing more) if the budget has not them."""
        self._budget._take(n)
        self.held += n

    def give_back(self, n: int) -> None:
        """Hold ``n`` bytes less (what a push needed only for a while)."""
        n = min(n, self.held)
        self._budget._give_back(n)
        self.held -= n
