"""The worker's core: turn a work order into a compressed contribution. No networking here.

A worker keeps one ``Session`` per coordinator run (the replica, error feedback, the local-SGD working copy).
A round runs in four stages:

  check (pure: version, fingerprint, token range; ``check``) -> advance the replica by the order's update
  -> compute (a strategy: one gradient, or H local steps; ``compute``) -> encode (error feedback + codec).

A delayed round (``compute_before_update``, ``coordinator train --overlap``) computes before the order's
own update is applied, so its gradient needs nothing the last round decided; when the order announced the
next batch, the engine computes that gradient as soon as the result is out (``worker.lookahead``), while
the result travels and the coordinator aggregates.

Anything that says the replica cannot be trusted becomes a NEEDS_STATE answer, not an exception: the
coordinator then pushes the state and the worker carries on. A push is loaded a tensor at a time as it
streams in (``push_parts``), into a new session that replaces the run's only once the state is complete.

On a node of several ranks (``worker.node``) every rank runs an engine: rank 0's takes the coordinator's
calls and first hands each one, as its protobuf bytes, to the others (``follow`` is their loop); every
rank then runs the same stages, the check's verdict is agreed on by all, and rank 0 encodes the node's
single payload. A rank that is lost makes the node's collectives fail: that is a ``NodeFailure``, which
the server answers UNAVAILABLE before the node is torn down and restarted.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from google.protobuf.message import Message

import gradwire
from gradwire import protocol, statestream
from gradwire.compression import (
    CompressedGradient,
    DecodedGradient,
    GradientCodec,
    NonFiniteInput,
    aggregate,
    serde,
    shard,
)
from gradwire.compression.fragment import Fragment, scoped
from gradwire.errors import AccessDenied, PeersUnreachable, TooLarge
from gradwire.memory import give_back_freed_memory
from gradwire.models import spec_elements
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import (
    BEHIND,
    NEEDS_STATE,
    OK,
    PROTOCOL_VERSION,
    UNREACHABLE,
    GossipLinks,
    GossipPieceRequest,
    ModelState,
    ProtocolError,
    RoundResult,
    WorkerInfo,
    WorkerState,
    WorkOrder,
)
from gradwire.replica import Fingerprint
from gradwire.security import same_owner
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker import gossip, lazy, lookahead
from gradwire.worker.budget import PushBudget
from gradwire.worker.check import ReplicaView, Verdict, check_order
from gradwire.worker.compute import Contribution, Placement, gradient_step, inner_steps, strategy_for
from gradwire.worker.node import (
    Command,
    NodeGroup,
    merge_rank_states,
    merge_shard_states,
)
from gradwire.worker.peers import Peers
from gradwire.worker.session import Session, host_tensors
from gradwire.worker.sizing import choose_node_mode, device_memory, physical_memory
from gradwire.worker.streaming import BucketStream, Emit

if TYPE_CHECKING:
    from gradwire.worker.bus import CollectiveBytes

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_MODEL_PARAMS = 2_000_000_000  # parameters and buffers of one run's model (--max-model-params)
# How large a request may be, in float32 copies of the caller's model (its run's, or --max-model-params
# for a caller with no run here yet), plus room for the token batch and framing. A state push holds the
# parameters, outer momentum, error feedback and the inner optimizer's moments; a work order holds every
# sender's payload of the last round (dense ones too, with --no-compression).
STATE_COPIES = 8
ORDER_COPIES = 32
REQUEST_SLACK = 64 << 20


class NodeFailure(RuntimeError):
    """A collective among the node's ranks failed (a rank died, hung past the timeout, or disagreed)."""


class WorkerEngine:
    """Serves rounds for any number of coordinator runs, one at a time; thread-safe."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        max_sessions: int = 2,
        placement: Placement | None = None,
        max_model_params: int = DEFAULT_MAX_MODEL_PARAMS,
        rank_memory: int | None = None,
        push_budget: int | None = None,
    ) -> None:
        """``rank_memory``: the bytes a run's state may use on this worker's device (each rank's, on a
        node; ``worker.sizing``); default: a CUDA device's memory, no limit on the CPU. ``push_budget``: the
        bytes the state pushes in flight may hold together (``worker.budget``); default: ``rank_memory``,
        or this machine's memory."""
        self.device = torch.device(device)
        self.rank_memory = rank_memory if rank_memory is not None else device_memory(self.device)
        self.push_budget = PushBudget(push_budget or self.rank_memory or physical_memory())
        self.max_sessions = max_sessions
        self.max_model_params = max_model_params
        self.placement = placement or Placement()
        self.node: NodeGroup | None = self.placement.node
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        # One round at a time: rounds of one run are sequential anyway, and two models' worth of
        # forward/backward at once would only fight over the same device.
        self._lock = threading.Lock()
        # All torch work runs on this one long-lived thread, not on whichever gRPC thread took the call:
        # each new calling thread gets an OpenMP team of its own, and idle teams spinning beside the busy
        # one cost ~5-15% of a CPU step (measured on gpt-10m: 2.21 s on one thread, 2.33-2.56 s on fresh ones).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-compute")
        self._giving_back = False  # a split node's rank gives freed memory back (gradwire.memory)
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-ahead")  # fingerprints
        # A streamed round's buckets are compressed here while the backward goes on (``worker.streaming``).
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-encode")
        self.lookaheads: collections.Counter[str] = (
            collections.Counter()
        )  # --overlap: gradients computed ahead "used" / "dropped"
        # What to do when the node loses a rank (the server sets it: stop, so that the node restarts).
        self.on_node_failure: Callable[[], None] = lambda: None
        # Peer-to-peer gossip: how this worker pulls its neighbours' messages (the server sets its token and TLS).
        self.peers = Peers()
        self._last_command = time.monotonic()
        self._push_ids = itertools.count()  # a node's ranks tell overlapping pushes apart by these
        if self.node is not None:
            lazy.for_nodes()  # now, before any call: what only a node's ranks use (worker.lazy)
        if self.node is not None and self.node.info.leader:
            # Every collective is bounded by the node's timeout, the command channel too, so an idle node
            # must keep talking: a heartbeat whenever no command went out for a while. A rank that stopped
            # answering (dead or hung) is then found within the timeout, idle or not.
            self._heartbeat_every = max(0.5, self.node.timeout / 4)
            threading.Thread(target=self._heartbeats, name="gradwire-node-heartbeat", daemon=True).start()

    def info(self, owner: bytes | None = None) -> WorkerInfo:
        """Who this worker is, and the versions of the runs ``owner`` owns (every run's if ``None``)."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        ranks = self.placement.ranks
        devices = (
            tuple(f"cuda:{r}" for r in range(ranks)) if self.device.type == "cuda" else (str(self.device),) * ranks
        )
        return WorkerInfo(
            PROTOCOL_VERSION,
            gradwire.__version__,
            torch.__version__,
            str(self.device),
            name,
            torch.cuda.device_count() if self.device.type == "cuda" else 1,
            {
                run: s.replica.version
                for run, s in list(self.sessions.items())
                if owner is None or same_owner(s.owner, owner)
            },
            ranks,
            devices,
            self._node_mode() if self.node is not None else "",
        )

    def _node_mode(self) -> str:
        """The node's mode: as started, or with --node-mode auto the one picked for the newest run; an fsdp
        node's ZeRO stage after a colon where it is not the default (``fsdp:optimizer``)."""
        placement = self.placement
        if placement.mode == "auto" and self.sessions:
            placement = next(reversed(self.sessions.values())).placement
        return f"fsdp:{placement.shard}" if placement.mode == "fsdp" and placement.shard != "full" else placement.mode

    def push_state(self, state: ModelState, owner: bytes = b"") -> tuple[int, Fingerprint]:
        """Start or replace the replica of ``state.run_id`` from a whole state in this process; it takes
        the path a push over the wire takes (``push_parts``)."""
        return self.push_parts(statestream.state_parts(state), sys.maxsize, owner=owner)

    def push_parts(
        self, parts: Iterator[pb.Part], max_bytes: int, limit_reason: str = "", owner: bytes = b""
    ) -> tuple[int, Fingerprint]:
        """Start or replace a run's replica from the framed state ``parts`` as they arrive (``statestream``):
        each tensor is loaded as soon as it is in, and on a node handed to every rank as it comes, each
        keeping its share; the state is never whole in memory. The run then belongs to ``owner``.

        The parts are read on the calling thread and only each tensor's load takes the compute thread, so a
        push that arrives slowly holds up no round (pushes may overlap: a node's ranks tell them apart by a
        number). ``AccessDenied`` if another owner holds that run (checked before any rank sees the state,
        and again before it is taken); ``ProtocolError`` for a malformed or incomplete state, which
        replaces nothing."""
        pieces = statestream.read_state(parts, max_bytes, limit_reason or "--max-message-mb")
        head = next(pieces)
        header = statestream.decode_header(head)
        push = next(self._push_ids).to_bytes(8, "little")
        run = header.run_id
        try:
            with self.push_budget.push() as held:
                placement = self._placement_for(header)
                split = placement.split
                if split:  # the ranks allocate their shards (or stage) as the push starts
                    held.take(4 * -(-_elements(header) // placement.ranks))
                session = self._on_compute(
                    self._owned, run, owner, self._begin_push, push, head, header, owner, placement
                )
                for piece in pieces:
                    held.take(len(piece))  # what the piece's tensor is about to allocate, or a little more
                    self._on_compute(self._push_piece, push, session, piece)
                    if split:  # each rank kept its share, in what it allocated as the push started
                        held.give_back(len(piece))
                return self._on_compute(self._owned, run, owner, self._end_push, push, session)
        except BaseException:
            if self.node is not None:
                with contextlib.suppress(Exception):  # a node that cannot hear it fails its next command anyway
                    self._on_compute(self._command, Command.PUSH_ABORT, push)
            raise

    def _on_compute(self, call: Callable[..., T], *args: object) -> T:
        return self._compute.submit(call, *args).result()

    def _begin_push(
        self, push: bytes, head: bytes, header: statestream.StateHeader, owner: bytes, placement: Placement
    ) -> Session:
        """Rank 0 (or a single device): announce the push to the other ranks and build its session."""
        self._command(Command.PUSH_BEGIN, push + head)
        return self._new_session(header, owner, placement)

    def _push_piece(self, push: bytes, session: Session, piece: bytes) -> None:
        session.load(*statestream.decode_tensor(piece))  # checked here before any other rank sees it
        self._command(Command.PUSH_TENSOR, push + piece)

    def _end_push(self, push: bytes, session: Session) -> tuple[int, Fingerprint]:
        """The state is all in: the other ranks take it only if every rank has it all (``PUSH_END``)."""
        session.loaded()
        if self.node is not None:
            self._command(Command.PUSH_END, push)
            with _NodeErrors():
                if not self.node.all_true(True):
                    raise RuntimeError("another rank of this node could not take the state (see its log)")
        log.info("run %r: state at version %d", session.run_id, session.replica.version)
        return self._install(session)

    def _command(self, command: Command, payload: bytes = b"") -> None:
        """Rank 0 of a node: hand the other ranks a command (nothing off a node)."""
        if self.node is not None:
            with _NodeErrors():
                self.node.send(command, payload)
            self._last_command = time.monotonic()

    def _owned(self, run_id: str, owner: bytes, call: Callable[..., T], *args: object) -> T:
        """``call(*args)`` if the run is new or ``owner``'s; runs on the compute thread, where sessions change."""
        session = self.sessions.get(run_id)
        if session is not None and not same_owner(session.owner, owner):
            raise AccessDenied(
                f"run {run_id!r} belongs to another coordinator (its run key or client certificate differs)"
            )
        return call(*args)

    def _lead(self, command: Command, message: Callable[[], Message], call: Callable[..., T], *args: object) -> T:
        """Rank 0 of a node: hand the other ranks the call's message, then make it here too.

        ``message`` builds the proto only on a node: a single-device worker serializes nothing twice.
        """
        if self.node is not None:
            self._command(command, message().SerializeToString())
        return call(*args)

    def _heartbeats(self) -> None:
        assert self.node is not None
        while True:
            time.sleep(self._heartbeat_every / 2)
            if time.monotonic() - self._last_command < self._heartbeat_every:
                continue
            try:
                self._compute.submit(self._beat).result()
            except NodeFailure as e:
                log.error("%s; stopping so that the node restarts", e)
                self.on_node_failure()
                return
            except RuntimeError:  # the executor shut down: the worker is stopping
                return

    def _beat(self) -> None:
        if time.monotonic() - self._last_command < self._heartbeat_every:
            return  # a call went out while this waited its turn
        with _NodeErrors():
            self.node.send(Command.HEARTBEAT)
        self._last_command = time.monotonic()

    def request_limit(self, owner: bytes, kind: str) -> int:
        """The most bytes a ``kind`` ("state" or "order") request from ``owner`` may declare: a multiple of
        the size of the owner's model here, or of ``max_model_params`` if it has no run here yet."""
        mine = [sum(s.replica.numels) for s in list(self.sessions.values()) if same_owner(s.owner, owner)]
        elements = max(mine) if mine else self.max_model_params
        # A node's state push may carry every rank's inner optimizer state (two moments each).
        copies = STATE_COPIES + 2 * (self.placement.ranks - 1) if kind == "state" else ORDER_COPIES
        return 4 * elements * copies + REQUEST_SLACK

    def _placement_for(self, state: statestream.StateHeader) -> Placement:
        """How this node computes ``state``'s run: as started, or by the model's size with --node-mode auto
        (every rank decides alike, from the same state)."""
        if self.placement.mode != "auto" or self.node is None:
            return self.placement
        elements = _elements(state)
        try:
            momentum = bool(UpdateRule.from_json(state.update_rule_json).momentum)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise ProtocolError(f"model state: {e}") from None
        mode, shard, why = choose_node_mode(
            elements,
            self.placement.ranks,
            self.rank_memory,
            momentum=momentum,
            shard=self.placement.shard,
            whole_model=state.gossip,
        )
        if mode is None:
            raise TooLarge(f"{why} (worker serve --rank-memory-gb, --nproc-per-node)")
        if self.node.info.leader:
            log.info("run %r: --node-mode auto picks %s: %s", state.run_id, mode, why)
        return dataclasses.replace(self.placement, mode=mode, shard=shard)

    def _new_session(
        self, header: statestream.StateHeader, owner: bytes, placement: Placement | None = None
    ) -> Session:
        """A session for the pushed state, sized and built (its tensors to come), replacing nothing yet, placed
        as ``placement`` says (default: ``_placement_for``). Each rank of a node keeps its own share of it:
        ``Session.load``."""
        placement = placement or self._placement_for(header)
        if placement.split and not self._giving_back:
            # A node splits a model because memory is short: its ranks give freed memory back (gradwire.memory).
            self._giving_back = give_back_freed_memory()
        return Session(header, self.device, owner, self.max_model_params, self.rank_memory, placement)

    def _install(self, session: Session) -> tuple[int, Fingerprint]:
        """Make a complete session the run's: the previous one of the run, if any, goes (a resync keeps what
        the push did not bring), and the least recently started runs beyond ``max_sessions``."""
        with self._lock:
            previous = self.sessions.pop(session.run_id, None)
            if previous is not None:
                session.carry_over(previous)
            self.sessions[session.run_id] = session
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)  # the least recently started run
            return session.replica.version, session.replica.fingerprint()

    def close_run(self, run_id: str, owner: bytes = b"") -> bool:
        """Drop ``run_id``'s session (its owner only); whether there was one. Ranks > 0 of a node keep
        theirs until it is replaced or evicted."""
        with self._lock:
            session = self.sessions.get(run_id)
            if session is None:
                return False
            if not same_owner(session.owner, owner):
                raise AccessDenied(f"run {run_id!r} belongs to another coordinator")
            del self.sessions[run_id]
            return True

    def worker_state(self, run_id: str, owner: bytes = b"") -> WorkerState:
        """What a checkpoint keeps of ``run_id`` here: the error feedback (rank 0 encodes a node's payload)
        and the inner optimizer state - every rank's, on a node whose ranks step apart (local-sgd)."""
        return self._compute.submit(self._worker_state, run_id, owner).result()

    def _worker_state(self, run_id: str, owner: bytes) -> WorkerState:
        with self._lock:
            session = self.sessions.get(run_id)
            if session is None:
                raise ProtocolError(f"no replica for run {run_id!r}")
            if not same_owner(session.owner, owner):
                raise AccessDenied(f"run {run_id!r} belongs to another coordinator")
            feedback, inner = host_tensors(session.feedback.state_dict()), host_tensors(session.committed_inner_state())
            if self.node is not None and (session.placement.own_inner_state or session.placement.split):
                with _NodeErrors():
                    self.node.send(Command.FETCH_STATE, run_id.encode())
                    parts = self.node.gather_bytes(b"")
                self._last_command = time.monotonic()
                others = [protocol.worker_state_from_proto(protocol.parse(pb.WorkerState, p)) for p in parts[1:]]
                if session.placement.split:  # each rank's feedback (of its tensors) and inner state (of its part)
                    world, mode = self.node.world_size, session.placement.mode
                    feedback = merge_shard_states([feedback, *(o.feedback for o in others)], world, mode)
                    inner = merge_shard_states([inner, *(o.inner_optimizer for o in others)], world, mode)
                else:  # local-sgd: rank 0 encodes (its feedback is the node's); each rank steps its own way
                    inner = merge_rank_states([inner, *(o.inner_optimizer for o in others)])
            own = {}
            if session.gossip is not None:  # gossip rounds: the worker's own model is part of the trajectory
                own = host_tensors(dict(zip(session.replica.params, session.own_model().parameters())))
            return WorkerState(run_id, session.replica.version, feedback, inner, own)

    def _hand_over_state(self, run_id: str) -> None:
        """Ranks > 0, on FETCH_STATE: hand rank 0 this rank's error feedback and inner state of ``run_id``."""
        assert self.node is not None
        session = self.sessions.get(run_id)
        if session is None:
            state = WorkerState(run_id, 0, {}, {})
        else:
            feedback, inner = host_tensors(session.feedback.state_dict()), host_tensors(session.inner_state())
            state = WorkerState(run_id, session.replica.version, feedback, inner)
        self.node.gather_bytes(protocol.worker_state_to_proto(state).SerializeToString())

    def run_round(
        self,
        order: WorkOrder,
        cancelled: Callable[[], bool] = lambda: False,
        owner: bytes = b"",
        emit: Emit | None = None,
    ) -> RoundResult:
        """One round of ``order``'s run; ``AccessDenied`` if that run is another owner's. A streamed order
        (``stream_buckets``) hands each piece of the gradient to ``emit`` as it is ready, from another
        thread; the result still holds the whole payload (the pieces put together)."""
        return self._compute.submit(self._owned, order.run_id, owner, self._own_round, order, cancelled, emit).result()

    def _own_round(self, order: WorkOrder, cancelled: Callable[[], bool], emit: Emit | None = None) -> RoundResult:
        """Put this worker's own payload back into the order's replay (left out on the wire), then run it;
        on a node, the other ranks get the whole order."""
        session = self.sessions.get(order.run_id)
        updates = (*order.catch_up, *([order.update] if order.update is not None else []))
        own = [u.own for u in updates if u.own is not None]
        if own:
            sent = session.last_sent if session is not None else None
            if sent is None or any(round_ != sent[0] for _, round_ in own):
                held = f"round {sent[0]}'s" if sent is not None else "none"
                return RoundResult(
                    NEEDS_STATE,
                    order.round,
                    f"the update leaves out this worker's payload of round {own[0][1]}, and it holds {held}",
                    version=session.replica.version if session else 0,
                )
            order = dataclasses.replace(
                order,
                update=order.update.with_own(sent[1]) if order.update is not None else None,
                catch_up=tuple(u.with_own(sent[1]) for u in order.catch_up),
            )
        return self._lead(
            Command.RUN_ROUND, lambda: protocol.order_to_proto(order), self._locked_round, order, cancelled, emit
        )

    def _locked_round(self, order: WorkOrder, cancelled: Callable[[], bool], emit: Emit | None = None) -> RoundResult:
        with self._lock, _NodeErrors(active=self.node is not None):
            return self._run_round(order, cancelled, emit)

    def follow(self) -> None:
        """Ranks > 0 of a node: make every call rank 0 hands over, until it says stop (or the node fails).

        A call that fails here fails on rank 0 too (the same bytes, the same code), which answers the
        coordinator; this rank only logs it and waits for the next. A state push comes a tensor at a time
        (``PUSH_BEGIN``, ``PUSH_TENSOR``..., then ``PUSH_END`` or ``PUSH_ABORT``): this rank keeps its share
        of each, and takes the state only if every rank could.
        """
        assert self.node is not None and not self.node.info.leader
        pushing: dict[bytes, Session | None] = {}  # pushes under way, by number (None: failed on this rank)
        while True:
            command, data = self.node.receive()
            if command == Command.STOP:
                return
            if command == Command.HEARTBEAT:
                continue
            push, data = (data[:8], data[8:]) if command in _PUSH_COMMANDS else (b"", data)
            try:
                if command == Command.PUSH_BEGIN:
                    pushing[push] = None
                    pushing[push] = self._new_session(statestream.decode_header(data), b"")
                elif command == Command.PUSH_TENSOR:
                    if (session := pushing.get(push)) is not None:
                        session.load(*statestream.decode_tensor(data))
                elif command == Command.PUSH_ABORT:
                    pushing.pop(push, None)
                elif command == Command.PUSH_END:
                    self._follow_push_end(pushing.pop(push, None))
                elif command == Command.FETCH_STATE:
                    self._hand_over_state(data.decode())
                else:
                    self._locked_round(protocol.order_from_proto(protocol.parse(pb.WorkOrder, data)), lambda: False)
            except ValueError as e:
                if command in (Command.PUSH_BEGIN, Command.PUSH_TENSOR):
                    pushing[push] = None  # dropped here; PUSH_END says so to rank 0
                log.warning("rank %d: %s rejected: %s", self.node.rank, command.name, e)

    def _follow_push_end(self, session: Session | None) -> None:
        """Ranks > 0 at ``PUSH_END``: complete the session, agree with the others, then take it."""
        assert self.node is not None
        ok = session is not None
        if session is not None:
            try:
                session.loaded()
            except ValueError as e:
                log.warning("rank %d: the pushed state is incomplete here: %s", self.node.rank, e)
                ok = False
        if self.node.all_true(ok) and session is not None:
            self._install(session)

    def stop_node(self) -> None:
        """Rank 0: tell the other ranks to leave ``follow`` (best effort: a lost rank cannot hear it)."""
        if self.node is not None and self.node.info.leader:
            try:
                self._compute.submit(self.node.send, Command.STOP).result(timeout=30)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("could not tell the node's ranks to stop: %s", e)

    def _run_round(self, order: WorkOrder, cancelled: Callable[[], bool], emit: Emit | None = None) -> RoundResult:
        t0 = time.perf_counter()
        session = self.sessions.get(order.run_id)
        # 1. check: may this replica serve the order? On a node, only if it may on every rank.
        self.placement.check_rows(order)
        verdict = check_order(order, _view(session))
        if self.node is not None and not self.node.all_true(verdict.ok) and verdict.ok:
            verdict = Verdict(False, "another rank of this node is out of sync", stale=True)
        if not verdict.ok:
            if session is not None and verdict.stale:
                session.stale = True
            if session is not None and not verdict.stale:  # sound, at another version: it may catch up by replay
                return RoundResult(BEHIND, order.round, verdict.reason, version=session.replica.version)
            return RoundResult(
                NEEDS_STATE, order.round, verdict.reason, version=session.replica.version if session else 0
            )
        assert session is not None
        replica = session.replica
        bus_before = self._bus_bytes()
        # 2. advance the replica to the round's version (every payload is validated before a parameter
        # moves); a delayed round (--overlap) applies the round's own update only after the compute.
        updates = (*order.catch_up, *([order.update] if order.update is not None else []))
        before = len(updates) - 1 if order.compute_before_update and order.update is not None else len(updates)
        known = _sent_decoded(session)
        for update in updates[:before]:
            replica.apply(update, known=known)
        session.note_replay(updates[:before])
        t_update = time.perf_counter()
        if order.gossip is not None:  # the worker's own model, mixed with its neighbours' (worker.gossip)
            return self._gossip_round(session, order, cancelled, t0)
        # 3. compute: one gradient, or H local steps on the working copy; or the gradient computed ahead.
        ahead, session.lookahead = session.lookahead, None
        use, why = ahead.serves(order, replica.version) if ahead is not None else (False, "")
        if ahead is not None:
            self.lookaheads["used" if use else "dropped"] += 1
            if not use:
                log.info("run %r round %d: the work computed ahead is dropped: %s", order.run_id, order.round, why)
                if ahead.inner_before is not None:  # its inner steps never happened
                    session.restore_inner(ahead.inner_before)
        # A split node's collectives are torch's own (FSDP2's gathers, a pipeline's sends): counted as issued,
        # around the calls that issue them only (every op under the mode goes through Python).
        counting = None
        if session.placement.split:
            from gradwire.worker import bus  # loaded as the node started, outside any round (worker.lazy)

            counting = bus.CollectiveBytes()
        session.feedback.beta = order.feedback_beta
        stream = self._stream(session, order, emit)
        try:
            with counting or contextlib.nullcontext():
                contribution, compute_seconds = self._contribution(
                    session, order, ahead if use else None, cancelled, stream
                )
        except BaseException:
            if stream is not None:
                stream.settle()  # nothing writes to the error feedback once the round is over
            raise
        t_computed = time.perf_counter()
        for update in updates[before:]:
            replica.apply(update, known=known)
        session.note_replay(updates[before:])
        t_compute = time.perf_counter()  # the encode starts
        update_seconds = (t_update - t0) + (t_compute - t_computed)
        # 4. encode: error feedback and the codec, on rank 0 of a node (a split node: on every rank, each its
        # own tensors; rank 0 assembles the payload); a streamed round's buckets not sent yet.
        if stream is not None:
            payload = self._finish_stream(session, stream, contribution)
        elif counting is not None:
            payload = self._encode_shards(session, order, contribution, counting)
            session.placement.bus.bytes += counting.bytes
            session.placement.bus.calls += counting.calls
        else:
            payload = self._encode(session, order, contribution)
        if payload is None:  # a rank > 0: rank 0 answers for the node
            return RoundResult(OK, order.round, "", None, contribution.loss, contribution.tokens, replica.version)
        session.last_sent = (order.round, payload)  # the coordinator leaves it out of the replay it sends back
        t_done = time.perf_counter()
        # The next round's check needs this replica's fingerprint: take it while the result travels and the
        # coordinator aggregates, not when the next order has arrived.
        if not session.placement.split:  # a split replica's fingerprint is a collective: taken in the check
            session.fingerprint_ahead = self._ahead.submit(replica.fingerprint)
        # Its replay sums this payload too: decode it now, while the CPU would wait (1/N of the replay's decoding),
        # and where that replay will take the sparse path, transform it back too.
        codec = replica.codec(order.codec, _fragment(order))
        session.sent_decoded = self._ahead.submit(decode_ahead, codec, payload, session.inverse_ahead(codec))
        if self.node is None and (expected := lookahead.preview(order, replica.version)) is not None:
            self._compute.submit(self._look_ahead, session, expected)  # runs once this round's result is out
        # Where the time since this run's last result went: the wait is what neither the round nor work
        # done ahead for it filled (``Session.done_at``, ``ahead_seconds``).
        wall = t_done - session.done_at if session.done_at is not None else t_done - t0
        wait = max(0.0, t0 - session.done_at - session.ahead_seconds) if session.done_at is not None else 0.0
        session.done_at, session.ahead_seconds = t_done, 0.0
        timings = {
            "update": update_seconds,
            "compute": compute_seconds,
            "compress": t_done - t_compute,
            "total": t_done - t0,
            "wait": wait,
            "wall": wall,
        }
        return RoundResult(
            OK,
            order.round,
            "",
            payload,
            contribution.loss,
            contribution.tokens,
            replica.version,
            timings,
            self._bus_bytes() - bus_before,
            contribution.grad_norm,
            contribution.fingerprint,
        )

    def _gossip_round(
        self, session: Session, order: WorkOrder, cancelled: Callable[[], bool], t0: float
    ) -> RoundResult:
        """A gossip round (``worker.gossip``): take the order's links, mix, train the worker's own model in
        place, and send its message. The replica does not move.

        On a node whose ranks each hold the whole model (ddp, local-sgd, zero1) every rank keeps the same
        gossip state: each takes the same links and mixes alike, the inner steps end with the same model on
        every rank (DDP's gradient all-reduce, local-sgd's parameter average), and each sends the same
        message; rank 0 answers for the node. Only rank 0 pulls from neighbours (``_pull_neighbours``)."""
        if session.placement.split:
            raise ProtocolError(
                f"gossip rounds need every rank to hold the whole model; this node splits it ({session.placement.mode})"
            )
        links, replica = order.gossip, session.replica
        assert links is not None
        codec = replica.codec(order.codec)
        working = session.own_model()
        model = dict(zip(replica.params, working.parameters()))
        keep = session.gossip is None and session.own_model_restored  # a resumed run's x came with the push
        leader = self.node is None or self.node.info.leader
        if links.pulls:  # peer-to-peer: the neighbours' messages come from them, then go in as relays would
            pulled = self._pull_neighbours(order, links, replica.version, cancelled)
            if isinstance(pulled, RoundResult):  # nothing taken: the coordinator relays them from now on
                return pulled
            links = pulled
        try:
            session.gossip = gossip.take_links(
                session.gossip, links, model, replica.params, codec, keep_model=keep, round_=order.round
            )
        except gossip.BadMessage as e:  # nothing taken; one pulled: the coordinator checks that sender's from now on
            if e.member not in order.gossip.pulls:
                raise
            return RoundResult(UNREACHABLE, order.round, str(e), version=replica.version, unreachable_peers=(e.member,))
        gossip.mix(session.gossip, links, model)
        t_compute = time.perf_counter()
        tokens = self._tokens(order.batch)
        loss, fingerprint = inner_steps(session, working, order, tokens, cancelled, session.placement)
        t_encode = time.perf_counter()
        payload, residual = gossip.send(session.gossip, model, codec)
        sent = None
        if not leader:  # rank 0 answers for the node
            return RoundResult(OK, order.round, "", None, loss, 0, replica.version)
        if links.peer_key:  # kept for the neighbours to pull; the coordinator gets its digest and sketches
            sent = gossip.keep_for_peers(session.gossip, order.round, payload, replica.params)
            payload = payload if links.upload else None  # uploaded for neighbours that cannot pull from it
        t_done = time.perf_counter()
        wall = t_done - session.done_at if session.done_at is not None else t_done - t0
        wait = max(0.0, t0 - session.done_at) if session.done_at is not None else 0.0
        session.done_at = t_done
        timings = {
            "update": t_compute - t0,
            "compute": t_encode - t_compute,
            "compress": t_done - t_encode,
            "total": t_done - t0,
            "wait": wait,
            "wall": wall,
        }
        tokens_in = tokens.shape[0] * (tokens.shape[1] - 1)
        return RoundResult(
            OK,
            order.round,
            "",
            payload,
            loss,
            tokens_in,
            replica.version,
            timings,
            gradient_fingerprint=fingerprint,
            gossip_residual=residual,
            gossip_sent=sent,
        )

    def _pull_neighbours(
        self, order: WorkOrder, links: GossipLinks, version: int, cancelled: Callable[[], bool]
    ) -> GossipLinks | RoundResult:
        """Peer-to-peer: the links with the messages they name pulled and put among the relays, or the round's
        answer if a neighbour could not be reached. On a node rank 0 pulls and hands the other ranks either
        one as protobuf bytes (a tag, then the message), so that all of them go on alike."""
        if self.node is not None and not self.node.info.leader:
            data = self.node.broadcast_bytes()
            if data[:1] == _PULLED:
                return protocol.gossip_from_proto(protocol.parse(pb.GossipLinks, data[1:]))
            if data[:1] == _UNREACHABLE:
                return protocol.result_from_proto(protocol.parse(pb.RoundResult, data[1:]))
            raise ProtocolError(f"round {order.round}: rank 0 gave the round up while it pulled the neighbours'")
        outcome: GossipLinks | RoundResult
        try:
            pulled = self.peers.pull(order.run_id, links.peer_key, links.pulls, cancelled)
            outcome = dataclasses.replace(links, relays={**links.relays, **pulled}, pulls={})
        except PeersUnreachable as e:
            outcome = RoundResult(UNREACHABLE, order.round, str(e), version=version, unreachable_peers=e.members)
        except BaseException:
            if self.node is not None:
                with _NodeErrors():
                    self.node.broadcast_bytes(b"-")  # the other ranks give the round up too
            raise
        if self.node is not None:
            if isinstance(outcome, RoundResult):
                data = _UNREACHABLE + protocol.result_to_proto(outcome).SerializeToString()
            else:
                data = _PULLED + protocol.gossip_to_proto(outcome).SerializeToString()
            with _NodeErrors():
                self.node.broadcast_bytes(data)
        return outcome

    def pull_gossip(self, request: GossipPieceRequest) -> bytes:
        """What ``Worker.PullGossip`` answers (``worker.gossip``): this worker's message of a round, or its
        public copy, as the serialized ``GossipPiece``. Authorised by the run's peer key, not by ownership:
        neighbours ask too. Never waits for a round: the gossip state has a lock of its own."""
        session = self.sessions.get(request.run_id)
        state = session.gossip if session is not None else None
        if state is None:
            raise AccessDenied(f"PullGossip: no peer-to-peer gossip of run {request.run_id!r} here")
        if not request.copy:
            return gossip.message_piece(state, request.peer_key, request.round)
        copy = gossip.copy_at(state, request.peer_key, request.round, request.last)
        return protocol.copy_piece_to_proto(state.node.member, request.round, copy).SerializeToString()

    def _contribution(
        self,
        session: Session,
        order: WorkOrder,
        ahead: lookahead.Lookahead | None,
        cancelled: Callable[[], bool],
        stream: BucketStream | None,
    ) -> tuple[Contribution, float]:
        """The round's contribution and its compute seconds: the one computed ahead, or one computed now. A
        streamed round's buckets leave as the backward finishes them, where the backward's gradient is the
        one sent (not clipped after it)."""
        if ahead is not None:
            return ahead.contribution, ahead.seconds
        t0 = time.perf_counter()
        tokens = self._tokens(order.batch)
        if stream is not None and not order.clip_grad_norm:
            hooks = stream.hooks(session.replica.params)
            contribution = gradient_step(session, order, tokens, cancelled, session.placement, hooks)
        else:
            contribution = strategy_for(order)(session, order, tokens, cancelled, session.placement)
        return contribution, time.perf_counter() - t0

    def _stream(self, session: Session, order: WorkOrder, emit: Emit | None) -> BucketStream | None:
        """A streamed order's pieces (``worker.streaming``), on a single device; a node sends its gradient
        whole, in the result (which the order allows)."""
        if order.stream_buckets < 2 or order.local_steps is not None or self.node is not None:
            return None
        plan = session.stream_plan(order.codec, order.stream_buckets)
        return BucketStream(plan, session.feedback, emit, self._encoder)

    def _finish_stream(self, session: Session, stream: BucketStream, contribution: Contribution) -> CompressedGradient:
        """The streamed round's whole payload, once every bucket is out; a NaN resets the error feedback."""
        try:
            return stream.finish(contribution.tensors)
        except NonFiniteInput:
            session.diverged()
            raise

    def _encode(self, session: Session, order: WorkOrder, contribution: Contribution) -> CompressedGradient | None:
        """Rank 0 (or a single device) compresses the contribution (``None`` on other ranks). A NaN or
        infinity found there resets the error feedback and inner state that took it in, on every rank of
        the node alike (they all trained the same way into it)."""
        payload, failure = None, None
        if self.node is None or self.node.info.leader:
            fragment = _fragment(order)
            try:
                codec = session.replica.codec(order.codec, fragment)
                payload = codec.compress(contribution.tensors, scoped(session.feedback, fragment))
            except NonFiniteInput as e:
                failure = e
        if self.node is not None:
            with _NodeErrors():
                diverged = not self.node.all_true(failure is None)
        else:
            diverged = failure is not None
        if diverged:
            session.diverged()  # the NaN is in the error feedback (and inner state) now: drop them
            if failure is not None:
                raise failure
        return payload

    def _encode_shards(
        self, session: Session, order: WorkOrder, contribution: Contribution, counting: CollectiveBytes
    ) -> CompressedGradient | None:
        """Every rank of a split node compresses the tensors it owns with its own error feedback
        (``compression.shard``); rank 0 assembles the payload a single device would send (``None`` elsewhere).
        The gathers to the encoding ranks count in ``counting``."""
        assert self.node is not None
        codec = session.replica.codec(order.codec)
        fragment = _fragment(order)
        mine = session.owned(order.codec)  # of the whole model, so that a rank encodes the same tensors each round
        if fragment is not None:  # ... of those this round sends
            mine = tuple(n for n in mine if n in contribution.tensors)
        if session.placement.sharded:
            from gradwire.worker.fsdp import gather_to

            # Each tensor is gathered to the rank that encodes it, one at a time, every rank in the same order.
            owners = shard.owners(codec.plan, self.node.world_size)
            owner = {name: rank for rank, names in enumerate(owners) for name in names}
            whole = {}
            with counting:
                for name, t in contribution.tensors.items():
                    full = gather_to(t, owner[name]) if lazy.is_dtensor(t) else t
                    if name in mine:
                        whole[name] = full
        else:  # a pipeline stage holds its tensors whole
            whole = {name: contribution.tensors[name] for name in mine}
        try:
            feedback = scoped(session.feedback, fragment)
            part, ok = (session.shard_codec(order.codec, mine).compress(whole, feedback) if mine else None), True
        except NonFiniteInput:
            part, ok = None, False
        with _NodeErrors():
            ok = self.node.all_true(ok)
            parts = self.node.gather_bytes(serde.gradient_to_bytes(part) if ok and part is not None else b"")
        if not ok:
            session.diverged()
            if self.node.info.leader:
                raise NonFiniteInput("a tensor of this node's gradient")
            return None
        if not self.node.info.leader:
            return None
        sent = session.replica.codec(order.codec, fragment).plan
        return shard.assemble(sent, [serde.gradient_from_bytes(p) for p in parts if p])  # b"": a rank with none

    def _tokens(self, batch: np.ndarray) -> torch.Tensor:
        tokens = torch.from_numpy(batch.astype("int64"))  # (rows, T + 1)
        if self.device.type == "cuda":  # page-locked, so the copy overlaps with the work queued before it
            tokens = tokens.pin_memory().to(self.device, non_blocking=True)
        return tokens

    def _look_ahead(self, session: Session, expected: WorkOrder) -> None:
        """On the compute thread, after a delayed round: the gradient the next order most likely asks for
        (``worker.lookahead``). Whatever goes wrong only means there is none."""
        with self._lock:
            if (
                self.sessions.get(expected.run_id) is not session
                or session.stale
                or session.replica.version != expected.base_version
            ):
                return
            t0 = time.perf_counter()
            inner_before = session.inner_state() if expected.local_steps is not None else None
            try:
                contribution = strategy_for(expected)(
                    session, expected, self._tokens(expected.batch), lambda: False, self.placement
                )
            except Exception as e:  # noqa: BLE001 - the round will compute it again, and say what fails
                log.warning("run %r: computing round %d ahead failed: %s", expected.run_id, expected.round, e)
                if inner_before is not None:
                    session.restore_inner(inner_before)
                return
            finally:
                session.ahead_seconds += time.perf_counter() - t0
            session.lookahead = lookahead.Lookahead(expected, contribution, time.perf_counter() - t0, inner_before)

    def _bus_bytes(self) -> int:
        """Bytes this rank has put on the node's bus so far (0 off a node)."""
        return self.placement.bus.bytes + (self.node.bytes_sent if self.node is not None else 0)


def _elements(header: statestream.StateHeader) -> int:
    """The parameters and buffers of the model a pushed state names (sized on the meta device)."""
    try:
        return spec_elements(json.loads(header.model_json))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ProtocolError(f"model state: {e}") from None


def _fragment(order: WorkOrder) -> Fragment | None:
    """The fragment a local-SGD round sends (``--fragments``); ``None``: the whole model."""
    return order.local_steps.fragment if order.local_steps is not None else None


def _view(session: Session | None) -> ReplicaView | None:
    if session is None:
        return None
    if session.fingerprint_ahead is not None:  # wait for the one being taken ahead rather than take it twice
        session.fingerprint_ahead.result()
        session.fingerprint_ahead = None
    r = session.replica
    return ReplicaView(r.version, r.fingerprint(), r.numels, session.vocab_size, session.stale)


def decode_ahead(codec: GradientCodec, payload: CompressedGradient, dtype: torch.dtype | None) -> DecodedGradient:
    """``payload`` decoded, with its inverse DCT in ``dtype`` (``aggregate.with_inverse``) unless that is None."""
    decoded = codec.decode(payload)
    list(decoded.dense)  # its factored matrices multiplied out now, while the worker waits, not in the replay
    return aggregate.with_inverse(codec, decoded, dtype) if dtype is not None else decoded


def _sent_decoded(session: Session) -> tuple[CompressedGradient, DecodedGradient] | None:
    """The last payload this worker sent and its decoded form, taken after that round (``Replica.apply``'s
    ``known``); ``None`` if there is none or it could not be decoded (then the replay decodes it, and says why)."""
    ahead, session.sent_decoded = session.sent_decoded, None
    if ahead is None or session.last_sent is None:
        return None
    try:
        return session.last_sent[1], ahead.result()
    except Exception:  # noqa: BLE001 - the replay decodes the payload itself and raises what is wrong
        return None


_PUSH_COMMANDS = (Command.PUSH_BEGIN, Command.PUSH_TENSOR, Command.PUSH_END, Command.PUSH_ABORT)


_PULLED, _UNREACHABLE = b"L", b"U"  # what rank 0 of a node hands its ranks after a peer-to-peer pull


class _NodeErrors:
    """Turns a failed collective (a lost or hung rank) into ``NodeFailure``; a no-op off a node."""

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        if self.active and isinstance(error, (dist.DistError, RuntimeError)) and not isinstance(error, NodeFailure):
            raise NodeFailure(f"the node lost a rank or its process group failed: {error}") from error
        return False
