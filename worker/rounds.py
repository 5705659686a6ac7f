"""A work order's round, as stages. No networking here; the engine (``worker.engine``) calls ``run``.

  check     may this replica serve the order? (``check_order``; on a node, every rank must agree)
  advance   replay the order's updates onto the replica (a delayed round: all but its own, which waits)
  compute   the contribution: one gradient, H inner steps, or the one computed ahead (``worker.lookahead``)
  advance   a delayed round's own update, now that the compute no longer needs the old parameters
  encode    error feedback and the codec (streamed buckets, a node's shards, or the whole payload at once)
  ahead     while the result travels: the replica's fingerprint, the payload decoded for the next replay,
            and under ``--overlap`` the next round's compute

Each stage is a function of the session and the order, so each is tested alone; ``run`` reads as their
sequence, and ``timings`` says where the round's wall time went.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from gradwire import protocol
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
from gradwire.protocol import BEHIND, NEEDS_STATE, OK, RoundResult, StateUpdate, WorkOrder
from gradwire.worker import lazy, lookahead
from gradwire.worker.check import ReplicaView, Verdict, check_order
from gradwire.worker.compute import Contribution, gradient_step, strategy_for
from gradwire.worker.node import NodeGroup
from gradwire.worker.session import Session
from gradwire.worker.streaming import BucketStream, Emit

if TYPE_CHECKING:
    from gradwire.worker.bus import CollectiveBytes

log = logging.getLogger(__name__)


class NodeFailure(RuntimeError):
    """A collective among the node's ranks failed (a rank died, hung past the timeout, or disagreed)."""


class NodeErrors:
    """Turns a failed collective (a lost or hung rank) into ``NodeFailure``; a no-op off a node."""

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        if self.active and isinstance(error, (dist.DistError, RuntimeError)) and not isinstance(error, NodeFailure):
            raise NodeFailure(f"the node lost a rank or its process group failed: {error}") from error
        return False


@dataclasses.dataclass
class Rounds:
    """What a round's stages run on: the worker's device, its node (``None`` off a node), and the threads that
    work beside the compute. ``look_ahead`` queues a call on the compute thread, after the round."""

    device: torch.device
    node: NodeGroup | None
    ahead: ThreadPoolExecutor  # fingerprints and decodes, taken while a result travels
    encoder: ThreadPoolExecutor  # a streamed round's buckets, compressed while the backward goes on
    look_ahead: Callable[[Session, WorkOrder], None]
    bus_bytes: Callable[[], int]  # the bytes this rank has put on the node's bus so far
    lookaheads: Counter[str] = dataclasses.field(default_factory=Counter)  # computed ahead: "used" / "dropped"
    resent: int = 0  # rounds asked for again and answered with the result computed before (``again``)

    def run(
        self, session: Session, order: WorkOrder, cancelled: Callable[[], bool], emit: Emit | None, t0: float
    ) -> RoundResult:
        """A checked order's round (``check`` said yes; not a gossip round): advance, compute, advance, encode,
        and start what the next round needs."""
        bus_before = self.bus_bytes()
        now, later = split_updates(order)
        if not now and not later and (again := self.again(session, order)) is not None:
            return again
        known = sent_decoded(session)
        advance(session, now, known)
        t_advanced = time.perf_counter()
        ahead = self.take_ahead(session, order)
        counting = _collectives(session)
        session.feedback.beta = order.feedback_beta
        stream = self.stream(session, order, emit)
        try:
            with counting or contextlib.nullcontext():
                contribution, compute_seconds = self.compute(session, order, ahead, cancelled, stream)
        except BaseException:
            if stream is not None:
                stream.settle()  # nothing writes to the error feedback once the round is over
            raise
        t_computed = time.perf_counter()
        advance(session, later, known)
        t_encode = time.perf_counter()
        payload = self.encode(session, order, contribution, stream, counting)
        if payload is None:  # a rank > 0: rank 0 answers for the node
            v = session.replica.version
            return RoundResult(OK, order.round, "", None, contribution.loss, contribution.tokens, v)
        session.last_sent = (order.round, payload)  # the coordinator leaves it out of the replay it sends back
        if order.peer_key:  # --relay peers: the other workers pull it from here
            session.peer_key = order.peer_key
            session.held.keep_payload(order.round, payload)
        t_done = time.perf_counter()
        self.prepare_next(session, order, payload)
        marks = Marks(t0, t_advanced, t_computed, t_encode, t_done)
        result = RoundResult(
            OK,
            order.round,
            "",
            payload,
            contribution.loss,
            contribution.tokens,
            session.replica.version,
            timings(session, marks, compute_seconds),
            self.bus_bytes() - bus_before,
            contribution.grad_norm,
            contribution.fingerprint,
        )
        # What it holds now: a delayed round computed before its own update, applied since; an order asking for
        # this round again at this version gets this result again (``again``).
        session.last_done = Done(order, session.replica.version, result)
        return result

    def again(self, session: Session, order: WorkOrder) -> RoundResult | None:
        """The result of a round this worker computed already, if ``order`` asks for that very round again (a
        coordinator restarted from its update log re-sends the round in flight, at the version the worker
        holds since: after a delayed round's own update too): sent again, not computed again, since its
        error feedback and inner state have moved on by it."""
        done = session.last_done
        if done is None:
            return None
        same, why = done.serves(order, session.replica.version)
        if same:
            log.info("run %r round %d: computed already; its result goes again", order.run_id, order.round)
            self.resent += 1
            return done.result
        return None

    def check(self, order: WorkOrder, session: Session | None) -> RoundResult | None:
        """The answer to an order this replica may not serve (``None``: it may). On a node every rank must
        agree; a replica found out of sync is marked stale until the next push."""
        verdict = check_order(order, view(session, order.fingerprint.has_moments))
        if self.node is not None and not self.node.all_true(verdict.ok) and verdict.ok:
            verdict = Verdict(False, "another rank of this node is out of sync", stale=True)
        if verdict.ok:
            return None
        version = session.replica.version if session is not None else 0
        if session is not None and verdict.stale:
            session.stale = True
        if session is not None and not verdict.stale:  # sound, at another version: it may catch up by replay
            return RoundResult(BEHIND, order.round, verdict.reason, version=version)
        return RoundResult(NEEDS_STATE, order.round, verdict.reason, version=version)

    def take_ahead(self, session: Session, order: WorkOrder) -> lookahead.Lookahead | None:
        """The contribution computed ahead for this order, if it serves it; one that does not is dropped (and
        the inner steps it took are undone)."""
        ahead, session.lookahead = session.lookahead, None
        if ahead is None:
            return None
        use, why = ahead.serves(order, session.replica.version)
        self.lookaheads["used" if use else "dropped"] += 1
        if use:
            return ahead
        log.info("run %r round %d: the work computed ahead is dropped: %s", order.run_id, order.round, why)
        if ahead.inner_before is not None:  # its inner steps never happened
            session.restore_inner(ahead.inner_before)
        return None

    def compute(
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
        tokens = self.tokens(order.batch)
        if stream is not None and not order.clip_grad_norm:
            hooks = stream.hooks(session.replica.params)
            contribution = gradient_step(session, order, tokens, cancelled, session.placement, hooks)
        else:
            contribution = strategy_for(order)(session, order, tokens, cancelled, session.placement)
        return contribution, time.perf_counter() - t0

    def stream(self, session: Session, order: WorkOrder, emit: Emit | None) -> BucketStream | None:
        """A streamed order's pieces (``worker.streaming``), on a single device; a node sends its gradient
        whole, in the result (which the order allows)."""
        if order.stream_buckets < 2 or order.local_steps is not None or self.node is not None:
            return None
        plan = session.stream_plan(order.codec, order.stream_buckets)
        return BucketStream(plan, session.feedback, emit, self.encoder)

    def encode(
        self,
        session: Session,
        order: WorkOrder,
        contribution: Contribution,
        stream: BucketStream | None,
        counting: CollectiveBytes | None,
    ) -> CompressedGradient | None:
        """The round's payload (``None`` on a rank > 0 of a node): a streamed round's buckets not sent yet,
        a split node's shards each encoded on its rank, or the whole contribution on rank 0."""
        if stream is not None:
            try:
                return stream.finish(contribution.tensors)
            except NonFiniteInput:
                session.diverged()
                raise
        if counting is not None:
            payload = self.encode_shards(session, order, contribution, counting)
            session.placement.bus.bytes += counting.bytes
            session.placement.bus.calls += counting.calls
            return payload
        return self.encode_whole(session, order, contribution)

    def encode_whole(self, session: Session, order: WorkOrder, contribution: Contribution) -> CompressedGradient | None:
        """Rank 0 (or a single device) compresses the contribution (``None`` on other ranks). A NaN or
        infinity found there resets the error feedback and inner state that took it in, on every rank of
        the node alike (they all trained the same way into it)."""
        payload, failure = None, None
        if self.node is None or self.node.info.leader:
            fragment = order_fragment(order)
            try:
                codec = session.replica.codec(order.codec, fragment)
                payload = codec.compress(contribution.tensors, scoped(session.feedback, fragment))
            except NonFiniteInput as e:
                failure = e
        if self.node is not None:
            with NodeErrors():
                diverged = not self.node.all_true(failure is None)
        else:
            diverged = failure is not None
        if diverged:
            session.diverged()  # the NaN is in the error feedback (and inner state) now: drop them
            if failure is not None:
                raise failure
        return payload

    def encode_shards(
        self, session: Session, order: WorkOrder, contribution: Contribution, counting: CollectiveBytes
    ) -> CompressedGradient | None:
        """Every rank of a split node compresses the tensors it owns with its own error feedback
        (``compression.shard``); rank 0 assembles the payload a single device would send (``None`` elsewhere).
        The gathers to the encoding ranks count in ``counting``."""
        assert self.node is not None
        codec = session.replica.codec(order.codec)
        fragment = order_fragment(order)
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
        with NodeErrors():
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

    def prepare_next(self, session: Session, order: WorkOrder, payload: CompressedGradient) -> None:
        """While the result travels and the coordinator aggregates: the replica's fingerprint (the next
        check needs it), this payload decoded (the next replay sums it: 1/N of its decoding, done while the
        worker would wait) and, for a delayed round that announced the next batch, the next compute."""
        replica = session.replica
        if not session.placement.split:  # a split replica's fingerprint is a collective: taken in the check
            # In the kind the next order asks for (``takes_moments``): its moments every --fingerprint-every.
            replica.moments_every = order.fingerprint_every
            session.fingerprint_ahead = self.ahead.submit(replica.fingerprint)
        codec = replica.codec(order.codec, order_fragment(order))
        session.sent_decoded = self.ahead.submit(decode_ahead, codec, payload, session.inverse_ahead(codec))
        if self.node is None and (expected := lookahead.preview(order, replica.version)) is not None:
            self.look_ahead(session, expected)

    def tokens(self, batch: np.ndarray) -> torch.Tensor:
        """The batch on the worker's device, as int64 token ids (rows, T + 1)."""
        tokens = torch.from_numpy(batch.astype("int64"))
        if self.device.type == "cuda":  # page-locked, so the copy overlaps with the work queued before it
            tokens = tokens.pin_memory().to(self.device, non_blocking=True)
        return tokens


def links_digest(order: WorkOrder) -> bytes:
    """A gossip order's links, as a digest (b"": not a gossip order): two orders with the same links ask the
    same of the worker's public copies."""
    if order.gossip is None:
        return b""
    return hashlib.sha256(protocol.gossip_to_proto(order.gossip).SerializeToString(deterministic=True)).digest()


@dataclasses.dataclass(frozen=True)
class Done:
    """The last round a worker computed for a run: its order, the replica version it held after it (a delayed
    round's: after its own update), its result, and a gossip round's links (``links_digest``; the order is kept
    without them, which may carry whole public copies)."""

    order: WorkOrder
    version: int
    result: RoundResult
    links: bytes = b""

    def serves(self, order: WorkOrder, version: int) -> tuple[bool, str]:
        """Whether ``order``, with the replica at ``version``, asks for this very computation again; and why
        not, when it does not."""
        made = self.order
        if (order.run_id, order.round) != (made.run_id, made.round):
            return False, f"round {made.round} was computed, the order is round {order.round}"
        if version != self.version:
            return False, f"left the replica at version {self.version}, the order finds it at {version}"
        if order.compute_before_update != made.compute_before_update:
            return False, "the order delays its update where the one computed did not, or the other way round"
        if links_digest(order) != self.links:
            return False, "the order's gossip links are not those the round took"
        if (why := lookahead.other_work(order, made)) is not None:
            return False, why
        if (order.codec, order.feedback_beta, order.fingerprint_gradient) != (
            made.codec,
            made.feedback_beta,
            made.fingerprint_gradient,
        ):
            return False, "the order encodes otherwise"
        return True, "the same round again"


@dataclasses.dataclass(frozen=True)
class Marks:
    """A round's clock readings (``time.perf_counter``): start, replica advanced, contribution computed,
    encode started (a delayed round's own update applied), result ready."""

    start: float
    advanced: float
    computed: float
    encode: float
    done: float


def timings(session: Session, marks: Marks, compute_seconds: float) -> dict[str, float]:
    """Where the round's time went, and the wall time since this run's last result here: the wait is what
    neither the round nor work done ahead for it filled (``Session.done_at``, ``ahead_seconds``). Moves the
    session's clock on to this result."""
    last = session.done_at
    wall = marks.done - last if last is not None else marks.done - marks.start
    wait = max(0.0, marks.start - last - session.ahead_seconds) if last is not None else 0.0
    session.done_at, session.ahead_seconds = marks.done, 0.0
    return {
        "update": (marks.advanced - marks.start) + (marks.encode - marks.computed),
        "compute": compute_seconds,
        "compress": marks.done - marks.encode,
        "total": marks.done - marks.start,
        "wait": wait,
        "wall": wall,
    }


def split_updates(order: WorkOrder) -> tuple[tuple[StateUpdate, ...], tuple[StateUpdate, ...]]:
    """The order's updates to apply before the compute, and after it: a delayed round
    (``compute_before_update``) computes before its own update, so only the catch-up goes first."""
    updates = (*order.catch_up, *([order.update] if order.update is not None else []))
    before = len(updates) - 1 if order.compute_before_update and order.update is not None else len(updates)
    return updates[:before], updates[before:]


def advance(
    session: Session, updates: Sequence[StateUpdate], known: tuple[CompressedGradient, DecodedGradient] | None
) -> None:
    """Replay ``updates`` onto the session's replica, in order (each validated before a parameter moves).
    ``known``: this worker's own last payload and its decoded form, which the replay need not decode again."""
    for update in updates:
        session.replica.apply(update, known=known)
    session.note_replay(updates)


def order_fragment(order: WorkOrder) -> Fragment | None:
    """The fragment a local-SGD round sends (``--fragments``); ``None``: the whole model."""
    return order.local_steps.fragment if order.local_steps is not None else None


def view(session: Session | None, with_moments: bool = True) -> ReplicaView | None:
    """What ``check_order`` reads of the session: its replica's version and fingerprint (the one taken ahead
    after the last round, waited for rather than taken twice; with its moments where the order's has them),
    sizes and vocabulary."""
    if session is None:
        return None
    if session.fingerprint_ahead is not None:
        session.fingerprint_ahead.result()
        session.fingerprint_ahead = None
    r = session.replica
    return ReplicaView(
        r.version, r.fingerprint(with_moments), r.numels, session.vocab_size, session.stale, session.parameter_names
    )


def decode_ahead(codec: GradientCodec, payload: CompressedGradient, dtype: torch.dtype | None) -> DecodedGradient:
    """``payload`` decoded, with its inverse DCT in ``dtype`` (``aggregate.with_inverse``) unless that is None."""
    decoded = codec.decode(payload)
    list(decoded.dense)  # its factored matrices multiplied out now, while the worker waits, not in the replay
    return aggregate.with_inverse(codec, decoded, dtype) if dtype is not None else decoded


def sent_decoded(session: Session) -> tuple[CompressedGradient, DecodedGradient] | None:
    """The last payload this worker sent and its decoded form, taken after that round (``Replica.apply``'s
    ``known``); ``None`` if there is none or it could not be decoded (then the replay decodes it, and says why)."""
    ahead, session.sent_decoded = session.sent_decoded, None
    if ahead is None or session.last_sent is None:
        return None
    try:
        return session.last_sent[1], ahead.result()
    except Exception:  # noqa: BLE001 - the replay decodes the payload itself and raises what is wrong
        return None


def _collectives(session: Session) -> CollectiveBytes | None:
    """A split node's collectives are torch's own (FSDP2's gathers, a pipeline's sends): counted as issued,
    around the calls that issue them only (every op under the mode goes through Python)."""
    if not session.placement.split:
        return None
    from gradwire.worker import bus  # loaded as the node started, outside any round (worker.lazy)

    return bus.CollectiveBytes()
