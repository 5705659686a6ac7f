"""The worker's core: turn a work order into a compressed gradient. No networking here.

A worker keeps one *session* per coordinator run: the model replica (built from the run's JSON spec),
the error-feedback buffers, and the codecs. For each order it brings the replica to the order's version
by applying the carried update, checks the replica's fingerprint against the coordinator's, runs
forward/backward on the token batch, and compresses the gradient with error feedback. Anything that
says the replica cannot be trusted becomes a NEEDS_STATE answer, not an exception: the coordinator then
pushes the state and the worker carries on.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

import gradwire
from gradwire.compression import ErrorFeedback
from gradwire.models import build_from_spec, lm_loss
from gradwire.protocol import (
    NEEDS_STATE,
    OK,
    PROTOCOL_VERSION,
    FeedbackState,
    ModelState,
    ProtocolError,
    RoundResult,
    WorkerInfo,
    WorkOrder,
)
from gradwire.replica import Fingerprint, Replica, UpdateRule, compare_fingerprints


class Cancelled(Exception):
    """The caller went away (cancelled call, deadline, shutdown): the round's work is abandoned."""


class Session:
    """One coordinator run's replica and error feedback on this worker."""

    def __init__(self, state: ModelState, device: torch.device) -> None:
        try:
            spec = json.loads(state.model_json)
            rule = UpdateRule.from_json(state.update_rule_json)
            model = build_from_spec(spec)
        except (ValueError, TypeError, KeyError) as e:
            raise ProtocolError(f"model state: {e}") from None
        self.run_id = state.run_id
        self.replica = Replica(model.to(device), rule)
        momentum = [state.optimizer_state[k] for k in sorted(state.optimizer_state, key=_numeric_suffix)]
        try:
            self.replica.load_state(state.parameters, momentum, state.version)
        except ValueError as e:
            raise ProtocolError(f"model state: {e}") from None
        self.vocab_size = _vocab_size(model)
        self.feedback = ErrorFeedback()
        if state.feedback:
            self.feedback.load_state_dict({k: v.to(device) for k, v in state.feedback.items()})
        self.stale = False


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Token ids must be below this; None if the model does not say."""
    get = getattr(model, "get_input_embeddings", None)  # transformers models
    emb = get() if callable(get) else getattr(model, "tok_emb", None)  # the built-in GPT
    return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else None


def _numeric_suffix(key: str) -> int:
    return int(key.rsplit(".", 1)[-1])


class WorkerEngine:
    """Serves rounds for any number of coordinator runs, one at a time; thread-safe."""

    def __init__(self, device: str | torch.device = "cpu", max_sessions: int = 2) -> None:
        self.device = torch.device(device)
        self.max_sessions = max_sessions
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        # One round at a time: rounds of one run are sequential anyway, and two models' worth of
        # forward/backward at once would only fight over the same device.
        self._lock = threading.Lock()
        # All torch work runs on this one long-lived thread, not on whichever gRPC thread took the call:
        # each new calling thread gets an OpenMP team of its own, and idle teams spinning beside the busy
        # one cost ~5-15% of a CPU step (measured on gpt-10m: 2.21 s on one thread, 2.33-2.56 s on fresh ones).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-compute")

    def info(self) -> WorkerInfo:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return WorkerInfo(
            PROTOCOL_VERSION, gradwire.__version__, torch.__version__, str(self.device), name,
            torch.cuda.device_count() if self.device.type == "cuda" else 1,
            {run: s.replica.version for run, s in self.sessions.items()},
        )

    def push_state(self, state: ModelState) -> tuple[int, Fingerprint]:
        return self._compute.submit(self._push_state, state).result()

    def _push_state(self, state: ModelState) -> tuple[int, Fingerprint]:
        session = Session(state, self.device)  # built and validated before it replaces anything
        with self._lock:
            previous = self.sessions.pop(state.run_id, None)
            if previous is not None and not state.feedback:
                # A resync of the same run keeps what this worker has not sent yet.
                session.feedback = previous.feedback
            self.sessions[state.run_id] = session
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)  # the least recently started run
            return session.replica.version, session.replica.fingerprint()

    def feedback_state(self, run_id: str) -> FeedbackState:
        with self._lock:
            session = self.sessions.get(run_id)
            if session is None:
                raise ProtocolError(f"no replica for run {run_id!r}")
            buffers = {k: v.detach().cpu() for k, v in session.feedback.state_dict().items()}
            return FeedbackState(run_id, session.replica.version, buffers)

    def run_round(self, order: WorkOrder, cancelled: Callable[[], bool] = lambda: False) -> RoundResult:
        return self._compute.submit(self._locked_round, order, cancelled).result()

    def _locked_round(self, order: WorkOrder, cancelled: Callable[[], bool]) -> RoundResult:
        with self._lock:
            return self._run_round(order, cancelled)

    def _run_round(self, order: WorkOrder, cancelled: Callable[[], bool]) -> RoundResult:
        t0 = time.perf_counter()
        session = self.sessions.get(order.run_id)

        def needs_state(reason: str) -> RoundResult:
            if session is not None:
                session.stale = True
            return RoundResult(NEEDS_STATE, order.round, reason, version=session.replica.version if session else 0)

        if session is None:
            return needs_state(f"no replica for run {order.run_id!r}")
        if session.stale:
            return needs_state("replica was found out of sync; waiting for a state push")
        if session.vocab_size is not None:
            # Checked here, before anything changes: an id past the embedding is an IndexError on a CPU
            # and a device-side assert on a GPU, which leaves the worker's CUDA context unusable.
            low, high = int(order.batch.min()), int(order.batch.max())
            if low < 0 or high >= session.vocab_size:
                raise ProtocolError(f"token id {high if high >= session.vocab_size else low} is outside the model's vocabulary [0, {session.vocab_size})")
        replica = session.replica
        if replica.version != order.base_version:
            return needs_state(f"replica at version {replica.version}, order starts from {order.base_version}")
        # The fingerprint is the coordinator's replica at base_version: check before moving on, so the
        # coordinator can send the order while it is still applying the same update to its own copy.
        same, why = compare_fingerprints(order.fingerprint, replica.fingerprint(), replica.numels, order.sync_tolerance)
        if not same:
            return needs_state(f"fingerprint mismatch at version {replica.version}: {why}")
        if order.update is not None:
            replica.apply(order.update)  # validates every payload before touching a parameter
        t_update = time.perf_counter()
        loss, tokens = self._gradient(replica, order, cancelled)
        t_compute = time.perf_counter()
        session.feedback.beta = order.feedback_beta
        grads = {n: p.grad for n, p in replica.params.items()}
        gradient = replica.codec(order.codec).compress(grads, session.feedback)
        t_done = time.perf_counter()
        timings = {"update": t_update - t0, "compute": t_compute - t_update, "compress": t_done - t_compute, "total": t_done - t0}
        return RoundResult(OK, order.round, "", gradient, loss, tokens, replica.version, timings)

    def _gradient(self, replica: Replica, order: WorkOrder, cancelled: Callable[[], bool]) -> tuple[float, int]:
        """Mean loss over the batch and its gradient in ``.grad``, by micro-batches if asked."""
        model = replica.model
        model.train()
        tokens = torch.from_numpy(order.batch.astype("int64")).to(self.device)  # (rows, T + 1)
        rows = tokens.shape[0]
        step = order.micro_batch_size or rows
        for p in model.parameters():
            p.grad = None
        total = 0.0
        for start in range(0, rows, step):
            if cancelled():
                raise Cancelled(f"round {order.round} cancelled")
            micro = tokens[start : start + step]
            loss = lm_loss(model, micro)
            # Weight each micro-batch by its share of rows: the sum is the full batch's mean loss.
            (loss * (micro.shape[0] / rows)).backward()
            total += loss.item() * micro.shape[0]
        for p in model.parameters():
            if p.grad is None:  # a parameter the loss does not reach still needs a (zero) gradient
                p.grad = torch.zeros_like(p)
        return total / rows, rows * (tokens.shape[1] - 1)
