"""The Worker service over gRPC: a thin layer that unframes requests, calls ``WorkerEngine``, frames replies.

Everything a request can get wrong is the engine's or the protocol module's to find; this module only maps
what they raise to status codes, so the server keeps serving after any bad request:

* ``ValueError`` (``ProtocolError``, ``PayloadError``: malformed framing, bytes, versions, payloads)
  -> INVALID_ARGUMENT, with the message. A protocol version mismatch is one of these too.
* ``Cancelled`` (the client cancelled, its deadline passed, or the server is stopping) -> CANCELLED.
* ``AccessDenied`` (the run belongs to another coordinator: ``gradwire.security``) -> PERMISSION_DENIED.
* ``NodeFailure`` (a node lost one of its ranks) -> UNAVAILABLE, and the server stops so that the node
  restarts; the coordinator resyncs it like any failed worker.
* anything else -> INTERNAL, with the traceback in the worker's log.

The deadline rule and the token are enforced by ``gradwire.interceptors`` in front of this; each call's
owner (its run key and client certificate, ``gradwire.security.caller``) goes to the engine, which keeps
runs apart.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from gradwire import protocol
from gradwire.compression import CompressedGradient
from gradwire.errors import MAX_DETAILS, status_for
from gradwire.protocol import PROTOCOL_VERSION, RoundResult, WorkOrder
from gradwire.security import caller
from gradwire.transport import DEFAULT_MESSAGE_MB
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.rounds import NodeFailure

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: WorkerEngine, *, max_message_mb: int = DEFAULT_MESSAGE_MB) -> None:
        self.engine = engine
        self.max_bytes = max_message_mb << 20

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.WorkerInfo:
        # Answer whatever version the caller speaks: the caller compares and explains the mismatch.
        if request.protocol_version != PROTOCOL_VERSION:
            log.warning(
                "%s speaks protocol %d, this worker %d", context.peer(), request.protocol_version, PROTOCOL_VERSION
            )
        try:
            return protocol.info_to_proto(self.engine.info(owner=caller(context)))
        except Exception as e:
            self._fail(context, "Describe", e)

    def PushState(self, request_iterator: Iterator[pb.Part], context: grpc.ServicerContext) -> pb.PushStateReply:
        try:
            owner = caller(context)
            # Read as it streams in, a tensor at a time (gradwire.statestream), never joined.
            version, fingerprint = self.engine.push_parts(request_iterator, *self._limit(owner, "state"), owner=owner)
            log.info("state at version %d from %s", version, context.peer())
            return pb.PushStateReply(version=version, fingerprint=protocol.fingerprint_to_proto(fingerprint))
        except Exception as e:
            self._fail(context, "PushState", e)

    def RunRound(self, request_iterator: Iterator[pb.Part], context: grpc.ServicerContext) -> Iterator[pb.Part]:
        try:
            owner = caller(context)
            msg = protocol.parse(pb.WorkOrder, self._join(request_iterator, owner, "order"))
            order = protocol.order_from_proto(msg)
        except Exception as e:
            self._fail(context, "RunRound", e)
        # Checked between micro-batches: a cancelled call, a passed deadline or a stopping server all make the
        # call inactive, and the engine abandons the round.
        round_ = _StreamedRound(self.engine, order, lambda: not context.is_active(), owner)
        try:
            for piece in round_.pieces():  # a streamed gradient's buckets, framed as the backward produces them
                yield from protocol.to_parts(protocol.piece_to_proto(order.round, piece))
            result = round_.result()
            if result.status != protocol.OK:
                log.info("round %d of run %r: %s (%s)", order.round, order.run_id, result.status, result.reason)
            parts = list(protocol.to_parts(protocol.result_to_proto(round_.rest(result))))
        except Exception as e:
            self._fail(context, "RunRound", e)
        yield from parts

    def FetchWorkerState(self, request: pb.FetchWorkerStateRequest, context: grpc.ServicerContext) -> Iterator[pb.Part]:
        try:
            parts = list(
                protocol.to_parts(
                    protocol.worker_state_to_proto(
                        self.engine.worker_state(
                            protocol.check_run_id(request.run_id, "FetchWorkerState"), owner=caller(context)
                        )
                    )
                )
            )
        except Exception as e:
            self._fail(context, "FetchWorkerState", e)
        yield from parts

    def CloseRun(self, request: pb.CloseRunRequest, context: grpc.ServicerContext) -> pb.CloseRunReply:
        try:
            closed = self.engine.close_run(protocol.check_run_id(request.run_id, "CloseRun"), owner=caller(context))
            if closed:
                log.info("run %r closed by %s", request.run_id, context.peer())
            return pb.CloseRunReply(closed=closed)
        except Exception as e:
            self._fail(context, "CloseRun", e)

    def PullGossip(self, request: pb.PullGossipRequest, context: grpc.ServicerContext) -> Iterator[pb.Part]:
        yield from self._pulled(
            context, "PullGossip", lambda: self.engine.pull_gossip(protocol.piece_request_from_proto(request))
        )

    def PullPiece(self, request: pb.PullPieceRequest, context: grpc.ServicerContext) -> Iterator[pb.Part]:
        yield from self._pulled(
            context, "PullPiece", lambda: self.engine.pull_piece(protocol.piece_pull_from_proto(request))
        )

    def _pulled(self, context: grpc.ServicerContext, method: str, held: Callable[[], bytes]) -> list[pb.Part]:
        """What a peer's pull answers: the bytes ``held`` returns, framed; or the call fails as ``_fail`` says."""
        try:
            return list(protocol.frame([held()]))
        except Exception as e:
            self._fail(context, method, e)

    def _join(self, parts: Iterator[pb.Part], owner: bytes, kind: str) -> bytes:
        return protocol.join_parts(parts, *self._limit(owner, kind))

    def _limit(self, owner: bytes, kind: str) -> tuple[int, str]:
        """The most bytes a request may declare, and why: a multiple of the caller's model's size
        (``WorkerEngine.request_limit``), or ``--max-message-mb`` where that is less. A request over it is
        refused on its first part, before anything is buffered."""
        by_model = self.engine.request_limit(owner, kind)
        if by_model < self.max_bytes:
            return by_model, "a multiple of the run's model size; --max-model-params for a new run"
        return self.max_bytes, "--max-message-mb"

    def _fail(self, context: grpc.ServicerContext, method: str, e: Exception) -> NoReturn:
        if isinstance(e, NodeFailure):
            log.error("%s from %s: %s; stopping so that the node restarts", method, context.peer(), e)
            self.engine.on_node_failure()  # a node without a rank cannot serve: stop, so that it restarts
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: {e}")
        _fail(context, method, e)


class _StreamedRound:
    """A round run on its own thread while the call's thread frames the pieces ``emit`` hands over."""

    def __init__(self, engine: WorkerEngine, order: WorkOrder, cancelled: Callable[[], bool], owner: bytes) -> None:
        self._queue: queue.SimpleQueue[CompressedGradient | None] = queue.SimpleQueue()
        self._sent = 0
        self._outcome: RoundResult | BaseException | None = None

        def run() -> None:
            try:
                self._outcome = engine.run_round(order, cancelled, owner, emit=self._queue.put)
            except BaseException as e:  # noqa: BLE001 - handed to the call's thread, which answers with it
                self._outcome = e
            finally:
                self._queue.put(None)

        threading.Thread(target=run, name="gradwire-round", daemon=True).start()

    def pieces(self) -> Iterator[CompressedGradient]:
        while (piece := self._queue.get()) is not None:
            self._sent += 1
            yield piece

    def result(self) -> RoundResult:
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def rest(self, result: RoundResult) -> RoundResult:
        """The result as the last message sends it: without the tensors its pieces carried."""
        if not self._sent or result.gradient is None:
            return result
        return dataclasses.replace(result, gradient=dataclasses.replace(result.gradient, tensors=()))


_LOGGED_AS = {grpc.StatusCode.PERMISSION_DENIED: "refused", grpc.StatusCode.INVALID_ARGUMENT: "rejected"}


def _fail(context: grpc.ServicerContext, method: str, e: Exception) -> NoReturn:
    """End the call with the status ``e`` deserves (``context.abort`` raises)."""
    code, text = status_for(e) or (grpc.StatusCode.INTERNAL, str(e)[:MAX_DETAILS])
    if code == grpc.StatusCode.CANCELLED or not context.is_active():
        # Reading a cancelled call's request stream raises a bare RpcError; nobody is listening anyway.
        log.info("%s from %s ended early: %s", method, context.peer(), text or type(e).__name__)
        context.abort(grpc.StatusCode.CANCELLED, f"{method} cancelled: {text}")
    if code != grpc.StatusCode.INTERNAL:
        log.warning("%s from %s %s: %s", method, context.peer(), _LOGGED_AS.get(code, "failed"), text)
        context.abort(code, text)
    log.exception("%s from %s failed", method, context.peer())
    context.abort(
        grpc.StatusCode.INTERNAL, f"{method} failed on the worker: {type(e).__name__}: {text} (see the worker's log)"
    )
