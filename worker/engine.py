"""The worker's core: turn a work order into a compressed contribution. No networking here.

A worker keeps one ``Session`` per coordinator run (the replica, error feedback, the local-SGD working copy).
A round runs in stages (``worker.rounds``; a gossip round's in ``worker.gossip_round``):

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
from typing import TypeVar

import torch
from google.protobuf.message import Message

import gradwire
from gradwire import protocol, statestream
from gradwire.errors import AccessDenied, NotHeld, PeersUnreachable, TooLarge
from gradwire.memory import give_back_freed_memory
from gradwire.models import spec_elements
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import (
    NEEDS_STATE,
    OK,
    PROTOCOL_VERSION,
    UNREACHABLE,
    GossipPieceRequest,
    ModelState,
    PieceRequest,
    ProtocolError,
    RoundResult,
    WorkerInfo,
    WorkerState,
    WorkOrder,
)
from gradwire.relay import ARRIVAL_WAIT
from gradwire.replica import Fingerprint, StateUpdate
from gradwire.security import same_owner
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker import gossip_round, lazy, lookahead, rounds
from gradwire.worker.budget import PushBudget
from gradwire.worker.compute import Placement, strategy_for
from gradwire.worker.node import (
    Command,
    NodeGroup,
    merge_rank_states,
    merge_shard_states,
)
from gradwire.worker.peers import Peers
from gradwire.worker.rounds import NodeErrors, NodeFailure
from gradwire.worker.session import Session, host_tensors
from gradwire.worker.sizing import choose_node_mode, device_memory, physical_memory
from gradwire.worker.streaming import Emit

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
        transform_dtype: torch.dtype | None = None,
    ) -> None:
        """``rank_memory``: the bytes a run's state may use on this worker's device (each rank's, on a
        node; ``worker.sizing``); default: a CUDA device's memory, no limit on the CPU. ``push_budget``: the
        bytes the state pushes in flight may hold together (``worker.budget``); default: ``rank_memory``,
        or this machine's memory. ``transform_dtype``: what its encodes' chunk DCT multiplies in (None: the
        device's fastest accurate one, ``compression.dct.fast_transform_dtype``; float32 makes a CPU's payloads
        the same on any CPU)."""
        self.device = torch.device(device)
        self.transform_dtype = transform_dtype
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
        # A round's stages (worker.rounds): fingerprints and decodes are taken on a thread of their own while
        # a result travels, and a streamed round's buckets compressed on another while the backward goes on.
        self.rounds = rounds.Rounds(
            self.device,
            self.node,
            ahead=ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-ahead"),
            encoder=ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-encode"),
            look_ahead=self._queue_look_ahead,
            bus_bytes=self._bus_bytes,
        )
        self.lookaheads = self.rounds.lookaheads  # --overlap: gradients computed ahead "used" / "dropped"
        # What to do when the node loses a rank (the server sets it: stop, so that the node restarts).
        self.on_node_failure: Callable[[], None] = lambda: None
        # Peer-to-peer gossip: how this worker pulls its neighbours' messages (the server sets its token and TLS).
        self.peers = Peers()
        self.pull_wait = ARRIVAL_WAIT  # seconds a peer's PullPiece waits for a payload this worker is about to hold
        self._last_command = time.monotonic()
        self._push_ids = itertools.count()  # a node's ranks tell overlapping pushes apart by these
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
            self.placement.precision,
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
            with NodeErrors():
                if not self.node.all_true(True):
                    raise RuntimeError("another rank of this node could not take the state (see its log)")
        log.info("run %r: state at version %d", session.run_id, session.replica.version)
        return self._install(session)

    def _command(self, command: Command, payload: bytes = b"") -> None:
        """Rank 0 of a node: hand the other ranks a command (nothing off a node)."""
        if self.node is not None:
            with NodeErrors():
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
        with NodeErrors():
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
        if placement.torch_parallel:
            lazy.for_nodes()  # now, before the run's first call: what only these modes use (worker.lazy)
        if placement.split and not self._giving_back:
            # A node splits a model because memory is short: its ranks give freed memory back (gradwire.memory).
            self._giving_back = give_back_freed_memory()
        return Session(
            header, self.device, owner, self.max_model_params, self.rank_memory, placement, self.transform_dtype
        )

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
                with NodeErrors():
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
        if session is not None and order.seed and order.update is not None:  # the peers pull them from here
            session.peer_key = order.peer_key
            for payload in (*order.update.payloads, *([order.update.delta] if order.update.delta else [])):
                session.held.keep_payload(order.round, payload)
        failed: tuple[str, ...] = ()  # relay sources that failed before another served: named in the result
        if session is not None and order.peer_key and any(u.relayed for u in (order.update, *order.catch_up) if u):
            try:
                order, failed = self._pulled(session, order, cancelled)
            except PeersUnreachable as e:
                v = session.replica.version
                return RoundResult(UNREACHABLE, order.round, str(e), version=v, unreachable_peers=e.members)
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
        result = self._lead(
            Command.RUN_ROUND, lambda: protocol.order_to_proto(order), self._locked_round, order, cancelled, emit
        )
        return dataclasses.replace(result, unreachable_peers=failed) if failed and result.status == OK else result

    def _pulled(
        self, session: Session, order: WorkOrder, cancelled: Callable[[], bool]
    ) -> tuple[WorkOrder, tuple[str, ...]]:
        """``order`` with its relayed payloads pulled from the peers it names (``Peers.pull_pieces``), each
        kept here for the other workers to pull in turn, and the sources that failed before another served;
        ``PeersUnreachable`` if one came from none of them."""
        session.peer_key = order.peer_key
        refs = [r for u in (*order.catch_up, order.update) if u is not None for r in u.relayed]
        pulled, failed = self.peers.pull_pieces(order.run_id, order.peer_key, refs, cancelled)
        for digest, (_, data) in pulled.items():  # checked against its digest as it came
            session.held.keep(order.round, data, digest)

        def filled(u: StateUpdate) -> StateUpdate:
            return u.with_pulled({r.position: pulled[r.digest][0] for r in u.relayed})

        whole = dataclasses.replace(
            order,
            update=filled(order.update) if order.update is not None else None,
            catch_up=tuple(filled(u) for u in order.catch_up),
        )
        return whole, failed

    def _locked_round(self, order: WorkOrder, cancelled: Callable[[], bool], emit: Emit | None = None) -> RoundResult:
        with self._lock, NodeErrors(active=self.node is not None):
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
        """The order's round (``worker.rounds``): check, advance, then a gossip round or compute and encode."""
        t0 = time.perf_counter()
        session = self.sessions.get(order.run_id)
        self.placement.check_rows(order)
        refused = self.rounds.check(order, session)
        if refused is not None:
            return refused
        assert session is not None
        if order.gossip is not None:  # the worker's own model, mixed with its neighbours' (worker.gossip_round)
            rounds.advance(session, rounds.split_updates(order)[0], rounds.sent_decoded(session))
            return self._gossip_round(session, order, cancelled, t0)
        return self.rounds.run(session, order, cancelled, emit, t0)

    def _gossip_round(
        self, session: Session, order: WorkOrder, cancelled: Callable[[], bool], t0: float
    ) -> RoundResult:
        return gossip_round.run(self.rounds, self.peers, session, order, cancelled, t0)

    def pull_piece(self, request: PieceRequest) -> bytes:
        """What ``Worker.PullPiece`` answers: a payload this worker holds for its peers (``gradwire.relay``), by
        digest. Authorised by the run's peer key, not by ownership: the run's other workers ask. Never waits
        for a round: the held pieces have a lock of their own."""
        session = self.sessions.get(request.run_id)
        if session is None or not session.peer_key or not same_owner(session.peer_key, request.peer_key):
            raise AccessDenied(f"PullPiece: no relayed round of run {request.run_id!r} here with that peer key")
        data = session.held.get(request.digest, wait=self.pull_wait)  # a seed's order or a pull may be on its way
        if data is None:
            raise NotHeld(f"PullPiece: no payload with digest {request.digest.hex()[:16]}... here")
        return data

    def pull_gossip(self, request: GossipPieceRequest) -> bytes:
        """What ``Worker.PullGossip`` answers (``gossip_round.piece``). Never waits for a round: the gossip
        state has a lock of its own."""
        return gossip_round.piece(self.sessions, request)

    def _queue_look_ahead(self, session: Session, expected: WorkOrder) -> None:
        self._compute.submit(self._look_ahead, session, expected)  # runs once this round's result is out

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
                    session, expected, self.rounds.tokens(expected.batch), lambda: False, self.placement
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


_PUSH_COMMANDS = (Command.PUSH_BEGIN, Command.PUSH_TENSOR, Command.PUSH_END, Command.PUSH_ABORT)
