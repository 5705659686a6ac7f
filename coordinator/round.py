"""The dispatch of one round: state pushes, concurrent work orders, retries, and what each worker did.

``RoundDispatcher.run`` pushes the full state to the workers that need it (``decisions.decide_sync``),
sends every worker its order concurrently, applies the pending update to the coordinator's own replica
while they compute, and handles a worker's NEEDS_STATE answer with a push and one retry. It never raises
for a worker's failure: each worker ends the round with a ``SlotOutcome``, a result or the error that
spoiled its share.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.decisions import Standing, decide_sync
from gradwire.coordinator.outer import OuterStrategy
from gradwire.protocol import NEEDS_STATE, OK, ModelState, ProtocolError, RoundResult, WorkOrder
from gradwire.replica import Fingerprint, StateUpdate

log = logging.getLogger("gradwire.coordinator")


@dataclasses.dataclass
class WorkerSlot:
    """A worker as the coordinator sees it. ``version`` is the replica version it is known to hold."""

    index: int
    client: WorkerClient
    version: int | None = None
    ranks: int = 1  # a node of several GPUs trains ranks x batch_size rows per step and counts as that many
    # What to restore on the worker with the next push (a resumed run): error feedback, inner optimizer.
    feedback: dict[str, torch.Tensor] | None = None
    inner_optimizer: dict[str, torch.Tensor] | None = None
    standing: Standing = dataclasses.field(default_factory=Standing)  # strikes and benching (decisions.judge)


@dataclasses.dataclass
class SlotOutcome:
    slot: WorkerSlot
    result: RoundResult | None
    error: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    pushes: int = 0  # state pushes during the round (a worker that reported NEEDS_STATE)


@dataclasses.dataclass
class RoundOutcome:
    outcomes: list[SlotOutcome]
    pushes: int  # every state push of the round, before it and on a retry
    push_bytes: int  # bytes of the pushes made before the round (retries count in their slot's outcome)


# (slot, base version, update or None, fingerprint of the base) -> the slot's work order
MakeOrder = Callable[[WorkerSlot, int, StateUpdate | None, Fingerprint], WorkOrder]
# slot -> the full state to push to it
MakeState = Callable[[WorkerSlot], ModelState]


@dataclasses.dataclass
class _Push:
    error: str = ""
    bytes_down: int = 0


class RoundDispatcher:
    def __init__(self, outer: OuterStrategy, pool: ThreadPoolExecutor, *, timeout: float) -> None:
        self.outer = outer
        self.pool = pool
        self.timeout = timeout

    def run(self, slots: Sequence[WorkerSlot], step: int, make_order: MakeOrder, make_state: MakeState) -> RoundOutcome:
        outer = self.outer
        base, target = outer.base_version, outer.target_version
        # Pushes first, from a replica nothing is writing to; then the round and, alongside it, our own
        # copy of the pending update.
        to_push = [s for s in slots if decide_sync(s.version, base, target)[0] == "push"]
        pushed = dict(zip((s.index for s in to_push), self.pool.map(lambda s: self._push(s, make_state), to_push)))
        applied = threading.Event()
        futures = [self.pool.submit(self._work, slot, step, pushed.get(slot.index), applied, make_order, make_state) for slot in slots]
        try:
            outer.apply_pending()
        finally:
            applied.set()  # never leave a worker's retry waiting, whatever happened here
        outcomes = [f.result() for f in futures]
        return RoundOutcome(outcomes, len(to_push) + sum(o.pushes for o in outcomes), sum(p.bytes_down for p in pushed.values()))

    def _work(self, slot: WorkerSlot, step: int, push: _Push | None, applied: threading.Event, make_order: MakeOrder, make_state: MakeState) -> SlotOutcome:
        """Everything one worker does this round; runs on the dispatch pool. Never raises."""
        outer = self.outer
        outcome = SlotOutcome(slot, None)
        if push is not None and push.error:
            outcome.error = push.error
            return outcome
        target = outer.target_version
        try:
            for _attempt in range(2):
                if slot.version == outer.base_version and outer.pending is not None:
                    order = make_order(slot, outer.base_version, outer.pending, outer.base_fingerprint)
                else:  # pushed at the round's version (a push after the pending update was applied)
                    applied.wait()
                    order = make_order(slot, target, None, outer.target_fingerprint)
                result = slot.client.run_round(order, timeout=self.timeout)
                outcome.bytes_down += slot.client.last_bytes_down
                outcome.bytes_up += slot.client.last_bytes_up
                if result.status == OK:
                    if result.round != step or result.version != target:
                        raise ProtocolError(f"result for round {result.round} at version {result.version}, expected {step} at {target}")
                    outcome.result = result
                    return outcome
                assert result.status == NEEDS_STATE
                log.info("step %d: worker %d needs the state (%s)", step, slot.index, result.reason)
                applied.wait()  # push the round's version, not one being written
                retry = self._push(slot, make_state)
                if retry.error:
                    raise WorkerError(slot.client.address, None, retry.error)
                outcome.pushes += 1
                outcome.bytes_down += retry.bytes_down
            outcome.error = "worker still out of sync after a state push"
        except (WorkerError, ValueError) as e:
            outcome.error = str(e)
        return outcome

    def _push(self, slot: WorkerSlot, make_state: MakeState) -> _Push:
        """Send the replica's full state (at its current version) to a worker. Never raises."""
        try:
            version, _ = slot.client.push_state(make_state(slot), timeout=self.timeout)
        except WorkerError as e:
            slot.version = None
            return _Push(error=str(e))
        slot.feedback = slot.inner_optimizer = None
        slot.version = version
        return _Push(bytes_down=slot.client.last_bytes_down)
