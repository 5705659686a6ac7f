"""The dispatch of one round: state pushes, concurrent work orders, retries, and what each worker did.

``RoundDispatcher.run`` pushes the full state to the workers that have never had it, sends every worker
its order concurrently, and applies the pending update to the coordinator's own replica while they
compute. A worker new to a running job gets the state *in the background* (``prepare``;
``decisions.decide_first_push``): the rounds go on without it while the state travels (a snapshot: the
replica moves on meanwhile), and it works from the first round after its push completes, catching up on
the updates it missed by replay, so a joiner on a slow link, or one that stalls mid-push, holds no round.
A worker whose version is not known (it failed or was cut off last round) gets an order as if it were in
step; a BEHIND answer says which version it holds, and if the updates it missed are still in
the replay window (and smaller than the state) it *catches up by replay*, else it gets the state pushed
(``decisions.decide_sync``). It never raises for a worker's failure: each worker ends the round with a
``SlotOutcome``, a result or the error that spoiled its share.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import grpc
import torch

from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.decisions import Grace, Standing, decide_close, decide_first_push, decide_sync
from gradwire.coordinator.outer import OuterStrategy
from gradwire.protocol import BEHIND, OK, ModelState, ProtocolError, RoundResult, WorkOrder
from gradwire.replica import Fingerprint, StateUpdate

log = logging.getLogger("gradwire.coordinator")


@dataclasses.dataclass
class WorkerSlot:
    """A worker as the coordinator sees it. ``version`` is the replica version it is known to hold."""

    index: int
    client: WorkerClient
    version: int | None = None
    guess: int | None = None  # the version it held when it was last heard of (its version is unknown now)
    device: str = ""  # as its Describe said
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
    catch_ups: int = 0  # orders that carried missed updates (catch-up by replay instead of a push)
    straggler: bool = False  # cut off after the round had its quorum and the grace ran out
    first_push_bytes: int = 0  # the state push before the round (a worker new to the run); not in bytes_down


@dataclasses.dataclass
class RoundOutcome:
    outcomes: list[SlotOutcome]
    pushes: int  # every state push of the round started: before it, in the background, on a retry
    push_bytes: int  # bytes of the pushes before the round, and of background ones that completed during it
    joining: tuple[int, ...] = ()  # slots receiving the state in the background, not in this round


# (slot, base version, update or None, fingerprint of the base, missed updates before it) -> the order
MakeOrder = Callable[[WorkerSlot, int, StateUpdate | None, Fingerprint, tuple[StateUpdate, ...]], WorkOrder]
# slot -> the full state to push to it
MakeState = Callable[[WorkerSlot], ModelState]


@dataclasses.dataclass
class _Push:
    error: str = ""
    bytes_down: int = 0


@dataclasses.dataclass
class RoundPlan:
    """Who works a round (``RoundDispatcher.prepare``), and the background pushes around it."""

    slots: list[WorkerSlot]  # not those receiving the state in the background
    started: int = 0  # background pushes started for this round
    landed: dict[int, _Push] = dataclasses.field(default_factory=dict)  # background pushes done since the last


class RoundDispatcher:
    def __init__(
        self,
        outer: OuterStrategy,
        pool: ThreadPoolExecutor,
        *,
        timeout: float,
        state_bytes: int = 0,
        quorum: int = 0,
        grace: Grace | None = None,
    ) -> None:
        self.outer = outer
        self.pool = pool
        self.timeout = timeout
        self.state_bytes = state_bytes  # a catch-up must cost less than a push of this
        self.quorum = quorum  # 0: wait for every worker
        self.grace = grace or Grace()
        self._joining: dict[int, Future[_Push]] = {}  # slot index -> its background push

    @property
    def joining(self) -> list[int]:
        """The slots receiving the state in the background now."""
        return sorted(i for i, f in self._joining.items() if not f.done())

    def prepare(self, slots: Sequence[WorkerSlot], step: int, make_state: MakeState) -> RoundPlan:
        """Which of ``slots`` work this round: not those receiving the state in the background. Starts the
        background pushes ``decisions.decide_first_push`` asks for (workers new to a running job)."""
        landed = self._landed()
        slots = [s for s in slots if s.index not in self._joining]
        new = [s for s in slots if s.version is None and s.guess is None]  # never had the state
        how, why = decide_first_push(len(new), len(slots) - len(new)) if new else ("block", "")
        if how == "background":
            for slot in new:
                log.info("step %d: worker %d gets the state in the background: %s", step, slot.index, why)
                state = _snapshot(make_state(slot))  # now: apply_pending writes to the replica during the round
                self._joining[slot.index] = self.pool.submit(self._push, slot, lambda _slot, state=state: state)
            return RoundPlan([s for s in slots if s not in new], len(new), landed)
        return RoundPlan(slots, 0, landed)

    def run(self, plan: RoundPlan, step: int, make_order: MakeOrder, make_state: MakeState) -> RoundOutcome:
        """The round of ``plan``'s slots."""
        outer, slots = self.outer, plan.slots
        to_push = [s for s in slots if s.version is None and s.guess is None]  # never had the state: the run's start
        # Blocking pushes first, from a replica nothing is writing to; then the round and, alongside it,
        # our own copy of the pending update.
        pushed = dict(zip((s.index for s in to_push), self.pool.map(lambda s: self._push(s, make_state), to_push)))
        applied = threading.Event()
        cut_off = {slot.index: threading.Event() for slot in slots}  # set for a straggler: make no further call
        futures = [
            self.pool.submit(
                self._work, slot, step, pushed.get(slot.index), applied, make_order, make_state, cut_off[slot.index]
            )
            for slot in slots
        ]
        try:
            outer.apply_pending()
        finally:
            applied.set()  # never leave a worker's retry waiting, whatever happened here
        cut = self._close(futures, slots, step, time.monotonic(), cut_off)
        outcomes = [f.result() for f in futures]  # the cut-off ones return at once, cancelled
        pushed.update(plan.landed)
        for o in outcomes:
            o.first_push_bytes = pushed[o.slot.index].bytes_down if o.slot.index in pushed else 0
            o.straggler = o.slot.index in cut and o.result is None
            if o.straggler:
                o.error = f"cut off as a straggler ({o.error})"
        pushes = len(to_push) + plan.started + sum(o.pushes for o in outcomes)
        return RoundOutcome(outcomes, pushes, sum(p.bytes_down for p in pushed.values()), tuple(self.joining))

    def _landed(self) -> dict[int, _Push]:
        """The background pushes that have completed (the slot's version is set, or reset on failure)."""
        done = {i: f for i, f in self._joining.items() if f.done()}
        for i in done:
            del self._joining[i]
        return {i: f.result() for i, f in done.items()}

    def _close(
        self,
        futures: list[Future[SlotOutcome]],
        slots: Sequence[WorkerSlot],
        step: int,
        start: float,
        cut_off: dict[int, threading.Event],
    ) -> set[int]:
        """Wait for the round's results until ``decisions.decide_close`` closes it; cancel the calls of the
        workers still computing then, and return their slot indices."""
        by_future = dict(zip(futures, slots))
        waiting, arrivals = set(futures), []
        while True:
            close, wait, why = decide_close(
                time.monotonic() - start, arrivals, len(waiting), quorum=self.quorum, grace=self.grace
            )
            if close:
                break
            done, waiting = wait_for(
                waiting, timeout=None if wait == float("inf") else wait, return_when=FIRST_COMPLETED
            )
            arrivals += [time.monotonic() - start for f in done if f.result().result is not None]
        for f in waiting:
            cut_off[by_future[f].index].set()  # before the cancel: a call it has not started yet never starts
            by_future[f].client.cancel()
        if waiting:
            log.info("step %d: %s", step, why)
        return {by_future[f].index for f in waiting}

    def _work(
        self,
        slot: WorkerSlot,
        step: int,
        push: _Push | None,
        applied: threading.Event,
        make_order: MakeOrder,
        make_state: MakeState,
        cut_off: threading.Event,
    ) -> SlotOutcome:
        """Everything one worker does this round; runs on the dispatch pool. Never raises.

        Up to three orders: as the worker is believed to stand; after a BEHIND answer, from the version it
        says it holds (a catch-up, when the window allows); after a push."""
        outer = self.outer
        outcome = SlotOutcome(slot, None)
        if push is not None and push.error:
            outcome.error = push.error
            return outcome
        target = outer.target_version
        version = slot.version if slot.version is not None else slot.guess
        try:
            for _attempt in range(4):  # an order, a catch-up order, a push, an order
                if cut_off.is_set():
                    raise WorkerError(slot.client.address, grpc.StatusCode.CANCELLED, "the round closed without it")
                action, why = decide_sync(version, outer.base_version, target, self._catch_up_bytes(version))
                if action == "push":
                    log.info("step %d: worker %d gets the state: %s", step, slot.index, why)
                    applied.wait()  # push the round's version, not one being written
                    retry = self._push(slot, make_state)
                    if retry.error:
                        outcome.error = retry.error
                        return outcome
                    outcome.pushes += 1
                    outcome.bytes_down += retry.bytes_down
                    version = slot.version
                    continue
                order = self._order(slot, action, version, applied, make_order)
                outcome.catch_ups += action == "catch-up"
                result = slot.client.run_round(order, timeout=self.timeout)
                outcome.bytes_down += slot.client.last_bytes_down
                outcome.bytes_up += slot.client.last_bytes_up
                if result.status == OK:
                    if result.round != step or result.version != target:
                        raise ProtocolError(
                            f"result for round {result.round} at version {result.version}, expected {step} at {target}"
                        )
                    outcome.result = result
                    return outcome
                log.info(
                    "step %d: worker %d is %s (%s)",
                    step,
                    slot.index,
                    "behind" if result.status == BEHIND else "out of sync",
                    result.reason,
                )
                # A sound replica at another version may catch up by replay; a missing or suspect one (or
                # one that claims the version it was just sent) gets the state.
                version = result.version if result.status == BEHIND and result.version != version else None
            outcome.error = "worker still out of sync after a state push"
        except (WorkerError, ValueError) as e:
            outcome.error = str(e)
        return outcome

    def _catch_up_bytes(self, version: int | None) -> int | None:
        """What the updates a worker at ``version`` missed (pending included) cost; ``None`` if they left
        the window or would cost more than a push."""
        if version is None:
            return None
        missed = self.outer.catch_up(version) if version <= self.outer.base_version else None
        if missed is None:
            return None
        total = sum(u.nbytes for u in missed[1]) + (self.outer.pending.nbytes if self.outer.pending is not None else 0)
        return total if not self.state_bytes or total < self.state_bytes else None

    def _order(
        self, slot: WorkerSlot, action: str, version: int | None, applied: threading.Event, make_order: MakeOrder
    ) -> WorkOrder:
        outer = self.outer
        if action == "replay":
            return make_order(slot, outer.base_version, outer.pending, outer.base_fingerprint, ())
        if action == "catch-up":
            assert version is not None
            fingerprint, missed = outer.catch_up(version)  # type: ignore[misc]
            return make_order(slot, version, outer.pending, fingerprint, missed)
        applied.wait()  # at the round's version (pushed after the pending update was applied, or current)
        return make_order(slot, outer.target_version, None, outer.target_fingerprint, ())

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


def _snapshot(state: ModelState) -> ModelState:
    """``state`` with its own copies of the replica's tensors (parameters, momentum), for a push that
    streams while the replica moves on."""
    return dataclasses.replace(
        state,
        parameters={n: t.detach().clone() for n, t in state.parameters.items()},
        optimizer_state={n: t.detach().clone() for n, t in state.optimizer_state.items()},
    )
