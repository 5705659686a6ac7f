"""The dispatch of one round: state pushes, concurrent work orders, retries, and what each worker did.

``RoundDispatcher.run`` pushes the full state to the workers that have never had it, sends every worker
its order concurrently, and once every order is out starts applying the pending update to the coordinator's
own replica on the replica's own thread (``OuterStrategy.advance``) while they compute; nothing in the round
waits for that apply but what needs the round's version (a push to a worker out of sync, the next round's
fingerprint).
A worker new to a running job gets the state *in the background* (``prepare``;
``decisions.decide_first_push``): the rounds go on without it while the state travels (a snapshot: the
replica moves on meanwhile), and it works from the first round after its push completes, catching up on
the updates it missed by replay, so a joiner on a slow link, or one that stalls mid-push, holds no round.
Every order is built from a ``RoundWork``, the round's plain values (batches, codec, local steps, scalars),
with the pending update as ``OuterStrategy.update_for`` gives it to that worker (a sender's replay leaves
out its own payload). A worker whose version is not known (it failed or was cut off last round) gets an
order as if it were in step; a BEHIND answer says which version it holds, and if the updates it missed are still in
the replay window (and smaller than the state) it *catches up by replay*, else it gets the state pushed
(``decisions.decide_sync``). It never raises for a worker's failure: each worker ends the round with a
``SlotOutcome``, a result or the error that spoiled its share, and the slots' known versions are updated
from what the round showed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import grpc
import numpy as np
import torch

from gradwire.compression import CodecConfig, CompressedGradient, DecodedGradient, PayloadError, products, robust
from gradwire.compression.stream import Pieces, StreamPlan
from gradwire.coordinator import copies
from gradwire.coordinator.decisions import Grace, Standing, decide_close, decide_first_push, decide_sync
from gradwire.coordinator.outer import OuterStrategy
from gradwire.coordinator.relay import Held, Relay, held_piece
from gradwire.link import WorkerError, WorkerLink
from gradwire.protocol import (
    BEHIND,
    OK,
    UNREACHABLE,
    GossipLinks,
    LocalSteps,
    ModelState,
    ProtocolError,
    RoundResult,
    WorkOrder,
)
from gradwire.replica import Fingerprint, StateUpdate

log = logging.getLogger("gradwire.coordinator")


# The most calls one slot makes in a round, each with its own deadline: a push, the round, and one retry of each.
CALLS_PER_SLOT = 4
# Seconds a cut-off slot's cancelled call has to end (cancelled again meanwhile, in case it started just as the
# cancel came); then the round gives up on it as failed, never waiting on a call its deadline did not end.
CANCEL_WAIT = 10.0
CANCEL_RETRY = 0.5


@dataclasses.dataclass
class WorkerSlot:
    """A worker as the coordinator sees it. ``version`` is the replica version it is known to hold."""

    index: int
    client: WorkerLink
    version: int | None = None
    guess: int | None = None  # the version it held when it was last heard of (its version is unknown now)
    device: str = ""  # as its Describe said
    ranks: int = 1  # a node of several GPUs trains ranks x batch_size rows per step and counts as that many
    node_mode: str = ""  # how a node's ranks split the work, as its Describe said; "" for a single device
    precision: str = "fp32"  # its forward/backward, as its Describe said: how a spot check recomputes it
    held: Mapping[str, int] = dataclasses.field(default_factory=dict)  # its replicas' versions, by run, as described
    # What to restore on the worker with the next push (a resumed run): error feedback, inner optimizer,
    # and in gossip rounds its own model.
    feedback: dict[str, torch.Tensor] | None = None
    inner_optimizer: dict[str, torch.Tensor] | None = None
    gossip_model: dict[str, torch.Tensor] | None = None
    standing: Standing = dataclasses.field(default_factory=Standing)  # strikes and benching (decisions.judge)
    checks: tuple[int, int] = (0, 0)  # spot checks of its gradients (coordinator.spotcheck): passed, failed


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
    seconds: float = 0.0  # from the round's dispatch until its answer came in, or it was cut off
    # The result's payload decoded as it arrived (``run``'s ``stream``), or why it could not be; and what the
    # gather stage measures of each sender alone, taken then too: its digest (``copies.digest``) and its norm
    # (``robust.payload_norm``; a factored matrix's is kept with the decoded payload's factors).
    decoded: DecodedGradient | None = None
    invalid: str = ""
    digest: copies.Digest | None = None
    empty: bool | None = None  # every value of it zero (``products.all_zero``)
    norm: float | None = None
    pieces: int = 0  # streamed pieces of its gradient received, of its last call (it may have failed after)
    unreachable: tuple[str, ...] = ()  # peer-to-peer gossip: neighbours it could not pull messages from
    held: Held | None = None  # --relay peers: its payload's digest and size, taken as it came in
    resent: int = 0  # --relay peers: orders sent again with the payloads in them, after a failed pull
    bytes_pulled: int = 0  # --relay peers: the payload bytes its order named, which it pulled from its peers


@dataclasses.dataclass
class RoundOutcome:
    outcomes: list[SlotOutcome]
    pushes: int  # every state push of the round started: before it, in the background, on a retry
    push_bytes: int  # bytes of the pushes before the round, and of background ones that completed during it
    joining: tuple[int, ...] = ()  # slots receiving the state in the background, not in this round
    # When (time.monotonic) the round's first order went out, and when it closed: its last result came in or
    # the rest were cut off. A round's turnaround is its first order's time less the last round's close.
    first_order_at: float | None = None
    closed_at: float | None = None


@dataclasses.dataclass(frozen=True)
class RoundWork:
    """What one round asks of its workers, as plain values; ``order`` makes one worker's work order."""

    round: int
    codec: CodecConfig
    batches: Mapping[int, np.ndarray]  # slot index -> its rows, (rows, T + 1)
    next_batches: Mapping[int, np.ndarray] = dataclasses.field(default_factory=dict)  # --overlap's look-ahead
    local_steps: LocalSteps | None = None  # None: gradient mode
    feedback_beta: float = 0.999
    micro_batch_size: int = 0
    sync_tolerance: float = 1e-4
    compute_before_update: bool = False  # --overlap
    clip_grad_norm: float = 0.0  # gradient mode (local-SGD rounds clip in ``local_steps``)
    slot_local_steps: Mapping[int, LocalSteps] = dataclasses.field(default_factory=dict)  # a slot's own (--balance)
    fingerprint_gradient: bool = False  # spot checks are on: every order asks for its gradient's fingerprint
    redundant: tuple[int, ...] = ()  # a spot check by redundancy: these slots got the first one's rows
    next_local_steps: Mapping[int, LocalSteps] = dataclasses.field(default_factory=dict)  # with next_batches
    stream_buckets: int = 0  # gradient mode: the gradient streams in this many pieces (compression.stream)
    gossip: Mapping[int, GossipLinks] = dataclasses.field(default_factory=dict)  # gossip rounds: a slot's links
    fingerprint_every: int = 1  # fingerprints hold their moments at the versions this divides (takes_moments)

    def local_steps_of(self, slot: int) -> LocalSteps | None:
        """Worker ``slot``'s inner steps (None: gradient mode)."""
        return self.slot_local_steps.get(slot, self.local_steps)

    def order(
        self,
        run_id: str,
        slot: int,
        base: int,
        update: StateUpdate | None,
        fingerprint: Fingerprint,
        catch_up: tuple[StateUpdate, ...] = (),
    ) -> WorkOrder:
        """Worker ``slot``'s order, starting from version ``base`` (whose ``fingerprint`` it checks)."""
        return WorkOrder(
            run_id,
            self.round,
            base,
            self.batches[slot],
            self.codec,
            fingerprint,
            update,
            feedback_beta=self.feedback_beta,
            micro_batch_size=self.micro_batch_size,
            sync_tolerance=self.sync_tolerance,
            local_steps=self.local_steps_of(slot),
            catch_up=catch_up,
            compute_before_update=self.compute_before_update,
            next_batch=self.next_batches.get(slot),
            clip_grad_norm=self.clip_grad_norm,
            fingerprint_gradient=self.fingerprint_gradient,
            next_local_steps=self.next_local_steps.get(slot) if slot in self.next_batches else None,
            stream_buckets=self.stream_buckets if self.local_steps_of(slot) is None else 0,
            gossip=self.gossip.get(slot),
            fingerprint_every=self.fingerprint_every,
        )


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
    """Runs rounds for one run (``run_id``) of the model ``spec`` whose replica ``outer`` holds."""

    def __init__(
        self,
        outer: OuterStrategy,
        pool: ThreadPoolExecutor,
        *,
        run_id: str,
        spec: dict,
        timeout: float,
        state_bytes: int = 0,
        quorum: int = 0,
        grace: Grace | None = None,
        gossip: bool = False,
        relay: Relay | None = None,
    ) -> None:
        self.outer = outer
        self.gossip = gossip  # gossip rounds: every push says so (ModelState.gossip)
        self.relay = relay or Relay(enabled=False)  # --relay peers: orders name payloads workers pull
        self.run_id, self.spec = run_id, spec
        self.pool = pool
        self.timeout = timeout
        self.state_bytes = state_bytes  # a catch-up must cost less than a push of this
        self.quorum = quorum  # 0: wait for every worker
        self.grace = grace or Grace()
        # Each result's payload as it arrives, on its call's thread, before it is decoded (the update log writes
        # it ahead of the round's record: ``Resumption.receive``; one that does not decode is read past there);
        # None: nobody.
        self.on_payload: Callable[[CompressedGradient], None] | None = None
        self._joining: dict[int, Future[_Push]] = {}  # slot index -> its background push
        self.first_order_at: float | None = None  # the round in flight's first order (time.monotonic)
        self._unordered = _Unordered([], lambda: None)  # the round in flight's slots whose order is not out yet

    @property
    def joining(self) -> list[int]:
        """The slots receiving the state in the background now."""
        return sorted(i for i, f in self._joining.items() if not f.done())

    def state_for(self, slot: WorkerSlot) -> ModelState:
        """The full state for a push to ``slot``, with what a resumed run restores on that worker."""
        state = self.outer.model_state(
            self.run_id, self.spec, slot.feedback or {}, slot.inner_optimizer or {}, slot=slot.index
        )
        state.gossip_model = dict(slot.gossip_model or {})
        state.gossip = self.gossip
        return state

    def prepare(self, slots: Sequence[WorkerSlot], step: int) -> RoundPlan:
        """Which of ``slots`` work this round: not those receiving the state in the background. Starts the
        background pushes ``decisions.decide_first_push`` asks for (workers new to a running job)."""
        landed = self._landed()
        slots = [s for s in slots if s.index not in self._joining]
        new = [s for s in slots if s.version is None and s.guess is None]  # never had the state
        how, why = decide_first_push(len(new), len(slots) - len(new)) if new else ("block", "")
        if how == "background":
            self.outer.settle()  # a snapshot of a replica nothing is writing to
            for slot in new:
                log.info("step %d: worker %d gets the state in the background: %s", step, slot.index, why)
                state = _snapshot(self.state_for(slot))  # now: the replica moves on meanwhile
                self._joining[slot.index] = self.pool.submit(self._push, slot, state)
            return RoundPlan([s for s in slots if s not in new], len(new), landed)
        return RoundPlan(slots, 0, landed)

    def run(self, plan: RoundPlan, work: RoundWork, stream: StreamPlan | None = None) -> RoundOutcome:
        """The round of ``plan``'s slots, each asked for its share of ``work``. With ``stream`` (the buckets of
        the round's codec), every result's payload is checked and decoded on its worker's thread as it
        arrives, a streamed one piece by piece (``SlotOutcome.decoded``), and what the gather stage measures of
        each sender alone is taken then too (whether it is empty, its copy digest, its factored matrices' norms)."""
        step = work.round
        outer, slots = self.outer, plan.slots
        to_push = [s for s in slots if s.version is None and s.guess is None]  # never had the state: the run's start
        # Blocking pushes first, from a replica nothing is writing to; then the round and, alongside it on the
        # replica's thread, our own copy of the pending update.
        if to_push:
            outer.settle()
        pushed = dict(zip((s.index for s in to_push), self.pool.map(self._push, to_push)))
        self.relay.plan_round([s.client.address for s in slots], step)
        cut_off = {slot.index: threading.Event() for slot in slots}  # set for a straggler: make no further call
        start = time.monotonic()
        self.first_order_at = None
        # Our replica's apply of the pending update starts once every order is out: started before them, it
        # took the cores the orders were being made and sent on (a push or a catch-up starts it at once).
        self._unordered = _Unordered([s.index for s in slots], outer.advance)
        futures = [
            self.pool.submit(self._timed, start, slot, work, pushed.get(slot.index), cut_off[slot.index], stream)
            for slot in slots
        ]
        cut = self._close(futures, slots, step, start, cut_off)
        closed_at = time.monotonic()
        closed = closed_at - start
        outcomes = self._outcomes(futures, slots, cut, step)
        pushed.update(plan.landed)
        for o in outcomes:
            o.first_push_bytes = pushed[o.slot.index].bytes_down if o.slot.index in pushed else 0
            o.straggler = o.slot.index in cut and o.result is None
            if o.slot.index in cut:
                o.seconds = closed
            if o.straggler:
                o.error = f"cut off as a straggler ({o.error})"
            _note_version(o, outer.target_version)
        pushes = len(to_push) + plan.started + sum(o.pushes for o in outcomes)
        return RoundOutcome(
            outcomes,
            pushes,
            sum(p.bytes_down for p in pushed.values()),
            tuple(self.joining),
            first_order_at=self.first_order_at,
            closed_at=closed_at,
        )

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
                time.monotonic() - start,
                arrivals,
                len(waiting),
                quorum=self.quorum,
                grace=self.grace,
                limit=CALLS_PER_SLOT * self.timeout + 5.0,
            )
            if close:
                break
            done, waiting = wait_for(
                waiting, timeout=None if wait == float("inf") else wait, return_when=FIRST_COMPLETED
            )
            arrivals += [f.result().seconds for f in done if f.result().result is not None]
        for f in waiting:
            cut_off[by_future[f].index].set()  # before the cancel: a call it has not started yet never starts
            by_future[f].client.cancel()
        if waiting:
            log.info("step %d: %s", step, why)
        return {by_future[f].index for f in waiting}

    def _outcomes(
        self, futures: list[Future[SlotOutcome]], slots: Sequence[WorkerSlot], cut: set[int], step: int
    ) -> list[SlotOutcome]:
        """Every slot's outcome once the round closed. A cut-off slot's call was cancelled and returns at once;
        one that started just as the cancel came is cancelled again until it ends; one still running
        ``CANCEL_WAIT`` seconds on (a call that neither its deadline nor its cancel ended: a link gRPC lost
        track of) is given up on as failed, its thread left to it."""
        pending = {f: slot for f, slot in zip(futures, slots) if slot.index in cut and not f.done()}
        deadline = time.monotonic() + CANCEL_WAIT
        while pending and (left := deadline - time.monotonic()) > 0:
            done, _ = wait_for(pending, timeout=min(CANCEL_RETRY, left))
            for f in done:
                del pending[f]
            for slot in pending.values():
                slot.client.cancel()
        out = []
        for f, slot in zip(futures, slots):
            if f in pending:
                why = f"its call did not end {CANCEL_WAIT:g} s after it was cancelled"
                log.warning("step %d: worker %d: %s", step, slot.index, why)
                out.append(SlotOutcome(slot, None, error=why))
            else:
                out.append(f.result())
        return out

    def _timed(
        self,
        start: float,
        slot: WorkerSlot,
        work: RoundWork,
        push: _Push | None,
        cut_off: threading.Event,
        stream: StreamPlan | None,
    ) -> SlotOutcome:
        """``_work``, its outcome stamped with the seconds from ``start`` on its own dispatch thread as the
        answer comes in: not when the round's thread next looks (two workers finishing while it was busy
        would look equally fast to the balancer and the grace)."""
        outcome = self._work(slot, work, push, cut_off, stream)
        outcome.seconds = time.monotonic() - start
        return outcome

    def _work(
        self,
        slot: WorkerSlot,
        work: RoundWork,
        push: _Push | None,
        cut_off: threading.Event,
        stream: StreamPlan | None = None,
    ) -> SlotOutcome:
        """Everything one worker does this round; runs on the dispatch pool. Never raises.

        Up to three orders: as the worker is believed to stand; after a BEHIND answer, from the version it
        says it holds (a catch-up, when the window allows); after a push."""
        outer, step = self.outer, work.round
        outcome = SlotOutcome(slot, None)
        if push is not None and push.error:
            outcome.error = push.error
            return outcome
        target = outer.target_version
        version = slot.version if slot.version is not None else slot.guess
        relayed = self.relay.enabled  # until a pull fails: then the payloads come in the order
        try:
            for _attempt in range(4):  # an order, a catch-up order, a push, an order; or an order sent again
                if cut_off.is_set():
                    raise WorkerError(slot.client.address, grpc.StatusCode.CANCELLED, "the round closed without it")
                action, why = decide_sync(version, outer.base_version, target, self._catch_up_bytes(version))
                if action == "push":
                    log.info("step %d: worker %d gets the state: %s", step, slot.index, why)
                    outer.wait_applied()  # push the round's version, not one being written
                    retry = self._push(slot)
                    if retry.error:
                        outcome.error = retry.error
                        return outcome
                    outcome.pushes += 1
                    outcome.bytes_down += retry.bytes_down
                    version = slot.version
                    continue
                order = self._order(slot, work, action, version, relayed)
                outcome.catch_ups += action == "catch-up"
                receiver = _Receiver(stream, outcome, self.on_payload)
                if self.first_order_at is None:
                    self.first_order_at = time.monotonic()
                self._unordered.out(slot.index)
                result, traffic = slot.client.run_round(order, timeout=self.timeout, on_piece=receiver.take)
                outcome.bytes_down += traffic.down
                outcome.bytes_up += traffic.up
                if result.status == OK:
                    if result.round != step or result.version != target:
                        raise ProtocolError(
                            f"result for round {result.round} at version {result.version}, expected {step} at {target}"
                        )
                    outcome.result = receiver.finish(result)
                    if self.relay.digest_payloads and outcome.result.gradient is not None:
                        outcome.held = held_piece(outcome.result.gradient, slot.client.address)
                    outcome.bytes_pulled = sum(r.size for u in (order.update, *order.catch_up) if u for r in u.relayed)
                    if _relays(order):  # pulled, some sources perhaps failing first
                        updates = (order.update, *order.catch_up)
                        self.relay.report(slot.client.address, updates, result.unreachable_peers, step, took=True)
                        outcome.unreachable = tuple(result.unreachable_peers)
                    return outcome
                if result.status == UNREACHABLE and relayed and _relays(order):  # took nothing: send them itself
                    log.info("step %d: worker %d could not pull relayed payloads: %s", step, slot.index, result.reason)
                    updates = (order.update, *order.catch_up)
                    self.relay.report(slot.client.address, updates, result.unreachable_peers, step, took=False)
                    outcome.unreachable += tuple(result.unreachable_peers)
                    outcome.resent += 1
                    relayed = False
                    continue
                if result.status == UNREACHABLE:  # a gossip round it took nothing of
                    outcome.error = f"worker {slot.client.address}: could not pull from its neighbours: {result.reason}"
                    outcome.unreachable = result.unreachable_peers
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
        finally:
            self._unordered.out(slot.index)  # no order after all: not waited for
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
        self, slot: WorkerSlot, work: RoundWork, action: str, version: int | None, relayed: bool = False
    ) -> WorkOrder:
        """Worker ``slot``'s order for ``action``; ``relayed``: it names the update's payloads its peers hold
        rather than carrying them (``--relay peers``)."""
        outer = self.outer
        if action == "replay":
            update = outer.update_for(slot.index)
            if relayed:
                update = self.relay.update_for(update, work.round, slot.client.address)
            order = work.order(self.run_id, slot.index, outer.base_version, update, outer.base_fingerprint)
        elif action == "catch-up":
            assert version is not None
            fingerprint, missed = outer.catch_up(version)  # type: ignore[misc]
            update = outer.update_for(slot.index)
            if relayed:  # each missed update's payloads from their senders too, while they hold them
                address = slot.client.address
                missed = tuple(self.relay.update_for(u, work.round, address, v) for v, u in enumerate(missed, version))
                update = self.relay.update_for(update, work.round, address)
            order = work.order(self.run_id, slot.index, version, update, fingerprint, missed)
        else:
            outer.wait_applied()  # at the round's version (pushed after the pending update was applied, or current)
            order = work.order(self.run_id, slot.index, outer.target_version, None, outer.target_fingerprint)
        if not self.relay.enabled:
            return order
        # A worker of the round's tree that gets the aggregate in its order keeps it for the peers below it.
        seed = order.update is not None and not order.update.relayed and self.relay.seeds(slot.client.address)
        return dataclasses.replace(order, peer_key=self.relay.peer_key, seed=seed)

    def _push(self, slot: WorkerSlot, state: ModelState | None = None) -> _Push:
        """Send ``state`` (default: the replica's full state at its current version) to a worker. Never raises."""
        try:
            (version, _), traffic = slot.client.push_state(state or self.state_for(slot), timeout=self.timeout)
        except WorkerError as e:
            slot.version = None
            return _Push(error=str(e))
        slot.feedback = slot.inner_optimizer = slot.gossip_model = None
        slot.version = version
        if slot.node_mode == "auto":  # the node picked its mode for this run's model: ask which, for the status
            try:
                slot.node_mode = slot.client.describe().node_mode
            except WorkerError:
                pass  # only the status page's; the next push asks again
        return _Push(bytes_down=traffic.down)


class _Receiver:
    """One call's payload, decoded as it arrives (``compression.stream.Pieces``). What is wrong with it is
    noted in the outcome (``invalid``), for the gather stage to judge, not raised: a bad payload is the
    sender's strike, not a failed call."""

    def __init__(
        self,
        stream: StreamPlan | None,
        outcome: SlotOutcome,
        on_payload: Callable[[CompressedGradient], None] | None = None,
    ) -> None:
        self.pieces = Pieces(stream) if stream is not None else None
        self.outcome, self.error = outcome, ""
        self.on_payload = on_payload  # the payload, whole, as soon as it is (``RoundDispatcher.on_payload``)
        outcome.pieces, outcome.decoded, outcome.invalid = 0, None, ""
        outcome.digest, outcome.empty, outcome.norm = None, None, None

    def take(self, piece: CompressedGradient) -> None:
        self.outcome.pieces += 1
        if self.pieces is None:
            raise ProtocolError("a streamed piece in a round that asked for none")
        if not self.error:
            try:
                self.pieces.take(piece)
            except PayloadError as e:
                self.error = f"sent a bad payload: {e}"

    def finish(self, result: RoundResult) -> RoundResult:
        """``result`` with the whole payload its pieces make; the outcome gets its decoding, or why not."""
        if self.pieces is None or result.gradient is None:
            return result
        if self.error:
            self.outcome.invalid = self.error
            return result
        whole = not self.pieces.received  # nothing streamed: the result holds the payload as it came
        if whole and self.on_payload is not None:
            self.on_payload(result.gradient)  # first: its bytes go to disk while it is decoded and measured
        try:
            payload, self.outcome.decoded = self.pieces.finish(result.gradient)
        except PayloadError as e:
            self.outcome.invalid = f"sent a bad payload: {e}"
            return result
        if not whole and self.on_payload is not None:
            self.on_payload(payload)  # a streamed one once its pieces make it
        self._measure(self.outcome.decoded)
        return dataclasses.replace(result, gradient=payload)

    def _measure(self, decoded: DecodedGradient) -> None:
        """What the gather stage asks of this sender alone, taken now, on its call's thread, while the others'
        results are still coming in: whether it holds anything, its copy digest and its norm (a factored
        matrix's, from its factors, is kept with them for the aggregate's). Only what is judged across senders
        is left for after the round's close."""
        assert self.pieces is not None  # ``finish`` decodes only with a stream plan
        plan = self.pieces.stream.codec.plan
        self.outcome.empty = products.all_zero((*decoded.values, *products.items(decoded.dense)))
        self.outcome.digest = copies.digest(decoded, [g.chunk_numel for g in plan.groups])
        self.outcome.norm = robust.payload_norm(decoded)


class _Unordered:
    """A round's slots whose order has not gone out yet; when the last one has (or its worker was given up
    on), ``then`` runs, once, on that slot's thread."""

    def __init__(self, slots: Sequence[int], then: Callable[[], None]) -> None:
        self._left, self._then = set(slots), then
        self._lock = threading.Lock()
        if not self._left:
            then()

    def out(self, slot: int) -> None:
        with self._lock:
            if slot not in self._left:
                return
            self._left.discard(slot)
            if self._left:
                return
        self._then()


def _relays(order: WorkOrder) -> bool:
    return any(u is not None and u.relayed for u in (order.update, *order.catch_up))


def _note_version(outcome: SlotOutcome, target: int) -> None:
    """What the round showed of the worker's version: the one its result was computed at; or, when it
    failed, unknown - the next round asks, and it may catch up by replay rather than get a push. A
    straggler most likely applied the round's update (``target``) before it was cut off."""
    slot = outcome.slot
    if outcome.result is not None:
        slot.version = outcome.result.version
        return
    slot.guess = target if outcome.straggler else slot.version if slot.version is not None else slot.guess
    slot.version = None


def _snapshot(state: ModelState) -> ModelState:
    """``state`` with its own copies of the replica's tensors (parameters, momentum), for a push that
    streams while the replica moves on."""
    return dataclasses.replace(
        state,
        parameters={n: t.detach().clone() for n, t in state.parameters.items()},
        optimizer_state={n: t.detach().clone() for n, t in state.optimizer_state.items()},
    )
