"""Fault injection for tests: workers that misbehave on purpose, at chosen rounds.

``FaultyEngine`` is the project's own ``WorkerEngine`` (served by the real servicer and server) whose
answers are tampered with after it computed them honestly, the way a compromised or broken worker would
(keeping a tampered payload as the one it sent, so that its replica stays the coordinator's):

* ``scale``       - the payload stands for ``factor`` times the real contribution (x1000, or -x1000 for a
                    sign-flipping attacker): decoded, scaled and encoded again with the run's codec;
* ``nan``         - a payload with a NaN in it;
* ``wrong-shape`` - a payload whose first tensor claims another shape;
* ``lie-tokens``  - an honest payload with ``factor`` times the tokens it trained on (to weigh more);
* ``drop``        - the call fails before the worker does anything, as when the network drops it (the
                    worker then holds the version it had: it missed that round's update);
* ``stall``       - the worker sits on the call for ``factor`` seconds before it starts (a straggler),
                    giving up early if the call is cancelled;
* ``slow``        - the worker computes ``factor`` times slower (a slower GPU): after each round's compute it
                    sits ``factor - 1`` times the compute time it reports, giving up early if the call is
                    cancelled;
* ``stall-push``  - the worker sits on a state push for ``factor`` seconds (a joiner on a slow link);
                    ``rounds`` counts pushes here (0: its first).
* ``copy``        - the worker sends, instead of its own payload, another sender's payload of the previous
                    round, as the round's replay brought it (a free rider); honest where there is none.
* ``sign-flip``   - the honest payload pointing the other way at its own norm: decoded, negated and encoded
                    again with the run's codec (what the norm clip cannot see);
* ``other-rows``  - the worker computes on rows other than those it was sent (each row's tokens rotated by
                    half its length: the same text cut elsewhere) and reports the tokens of the batch it
                    was sent;
* ``die-mid-stream`` - in a streamed round (``WorkOrder.stream_buckets``) the worker sends its first piece
                    and then fails, as a process that dies mid-stream: the call ends with an error;
* ``zeros``       - a valid payload whose values are all zero, with the tokens of the batch it was sent (a
                    free rider that computes nothing);
* ``other-message`` - in peer-to-peer gossip rounds, the worker serves its neighbours other bytes than the
                    message whose digest it reported, for the messages of ``rounds``;
* ``bad-message`` - in peer-to-peer gossip rounds, the worker's messages of ``rounds`` carry a NaN scale,
                    and it reports their digests honestly (and uploads them when told to).

Use it through ``faulty(action, ...)``, an engine factory for ``tests.integration.conftest.live_workers``.

``supervise`` is the coordinator's fault: a supervisor loop that SIGKILLs a coordinator process at random
points and starts the same command again, as systemd or a Deployment would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from gradwire import protocol
from gradwire.compression import CompressedGradient
from gradwire.protocol import OK, GossipPieceRequest, RoundResult, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker.compute import Cancelled
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.session import Session
from gradwire.worker.streaming import Emit

ACTIONS = (
    *("scale", "nan", "wrong-shape", "lie-tokens", "drop", "stall", "stall-push", "copy"),
    *("sign-flip", "other-rows", "zeros"),  # honest-looking payloads that do not help (coordinator.agreement)
    "slow",  # an honest worker that is slower than the others (coordinator.balance)
    "die-mid-stream",  # a streamed gradient cut off after its first piece (compression.stream)
    "other-message",  # a gossip message served to the neighbours that is not the one reported (worker.peers)
    "bad-message",  # a gossip message that does not decode, with its honest digest (worker.gossip, coordinator.gossip)
)


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """What to do, and in which rounds (``None``: every round)."""

    action: str
    factor: float = 1000.0
    rounds: Collection[int] | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault {self.action!r}; known: {ACTIONS}")

    def applies(self, round: int) -> bool:
        return self.rounds is None or round in self.rounds


class FaultyEngine(WorkerEngine):
    """A worker engine that tampers with its own OK results as ``plan`` says; ``injected`` lists the rounds."""

    def __init__(self, plan: FaultPlan, device: str = "cpu", **kwargs: object) -> None:
        super().__init__(device, **kwargs)
        self.plan = plan
        self.injected: list[int] = []
        self.pushes = 0  # state pushes received so far
        self.last_order: WorkOrder | None = None

    def push_parts(
        self, parts: Iterator[pb.Part], max_bytes: int, limit_reason: str = "", owner: bytes = b""
    ) -> tuple[int, Fingerprint]:
        if self.plan.action == "stall-push" and self.plan.applies(self.pushes):
            self.injected.append(self.pushes)
            time.sleep(self.plan.factor)
        self.pushes += 1
        return super().push_parts(parts, max_bytes, limit_reason, owner)

    def run_round(
        self,
        order: WorkOrder,
        cancelled: Callable[[], bool] = lambda: False,
        owner: bytes = b"",
        emit: Emit | None = None,
    ) -> RoundResult:
        self.last_order = order  # as it came, for a test to send again
        if self.plan.action == "drop" and self.plan.applies(order.round):
            self.injected.append(order.round)
            raise Cancelled(f"round {order.round} dropped (fault injection)")
        if self.plan.action == "stall" and self.plan.applies(order.round):
            self.injected.append(order.round)
            _sit(self.plan.factor, cancelled, f"round {order.round} cancelled while stalled")
        if self.plan.action == "other-rows" and self.plan.applies(order.round):
            self.injected.append(order.round)
            order = dataclasses.replace(order, batch=np.roll(order.batch, order.batch.shape[1] // 2, axis=1))
        if self.plan.action == "die-mid-stream" and self.plan.applies(order.round) and emit is not None:
            self.injected.append(order.round)
            emit = _dying(emit, order.round)
        result = super().run_round(order, cancelled, owner, emit)
        if self.plan.action == "slow" and self.plan.applies(order.round) and result.status == OK:
            self.injected.append(order.round)
            seconds = (self.plan.factor - 1) * result.timings.get("compute", 0.0)
            _sit(seconds, cancelled, f"round {order.round} cancelled while slowed")
            return result
        if (
            self.plan.action in ("drop", "stall", "stall-push", "other-rows", "die-mid-stream")
            or self.plan.action in ("other-message", "bad-message")  # gossip: tampered with where they are kept
            or result.status != OK
            or result.gradient is None
            or not self.plan.applies(order.round)
            or (self.plan.action == "copy" and (order.update is None or not order.update.payloads))
        ):
            return result
        self.injected.append(order.round)
        changes = self._tamper(order, result)
        session = self.sessions.get(order.run_id)
        if "gradient" in changes and session is not None:
            # It keeps what it sent as its own, so that its replays add what the coordinator aggregated: an
            # attacker that stays in sync (and whose gradients a spot check then finds honest).
            session.last_sent, session.sent_decoded = (order.round, changes["gradient"]), None
        return dataclasses.replace(result, **changes)

    def _gossip_round(
        self, session: Session, order: WorkOrder, cancelled: Callable[[], bool], t0: float
    ) -> RoundResult:
        result = super()._gossip_round(session, order, cancelled, t0)
        if self.plan.action != "bad-message" or not self.plan.applies(order.round) or result.gossip_sent is None:
            return result
        self.injected.append(order.round)
        state, member = session.gossip, order.gossip.member  # type: ignore[union-attr]
        honest = protocol.message_from_piece(state.outbox[order.round], member, order.round)
        first, *rest = honest.tensors
        payload = _with_first(honest, dataclasses.replace(first, scale=float("nan")), rest)
        bad = protocol.message_piece_to_bytes(member, order.round, payload)
        state.outbox[order.round] = bad
        sent = dataclasses.replace(result.gossip_sent, digest=hashlib.sha256(bad).digest(), nbytes=len(bad))
        return dataclasses.replace(result, gossip_sent=sent, gradient=payload if result.gradient else None)

    def pull_gossip(self, request: GossipPieceRequest) -> bytes:
        """``other-message``: a peer-to-peer gossip worker that serves its neighbours, for the planned rounds,
        other bytes than the message whose digest it reported."""
        data = super().pull_gossip(request)
        if self.plan.action == "other-message" and not request.copy and self.plan.applies(request.round):
            self.injected.append(request.round)
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    def _tamper(self, order: WorkOrder, result: RoundResult) -> dict[str, object]:
        plan, gradient = self.plan, result.gradient
        assert gradient is not None
        if plan.action == "copy":
            assert order.update is not None
            return {"gradient": order.update.payloads[0]}  # the replay leaves this worker's own out
        if plan.action == "lie-tokens":
            return {"tokens": int(result.tokens * plan.factor)}
        if plan.action in ("scale", "sign-flip", "zeros"):
            codec = self.sessions[order.run_id].replica.codec(gradient.settings)
            dense = codec.decompress(gradient)
            factor = {"scale": plan.factor, "sign-flip": -1.0, "zeros": 0.0}[plan.action]
            return {"gradient": codec.compress({k: v * factor for k, v in dense.items()})}
        first, *rest = gradient.tensors
        if plan.action == "nan":
            return {"gradient": _with_first(gradient, dataclasses.replace(first, scale=float("nan")), rest)}
        assert plan.action == "wrong-shape"
        return {
            "gradient": _with_first(gradient, dataclasses.replace(first, shape=tuple(s + 1 for s in first.shape)), rest)
        }


def _sit(seconds: float, cancelled: Callable[[], bool], why: str) -> None:
    """Sleep ``seconds``, raising ``Cancelled(why)`` as soon as the call is cancelled."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if cancelled():
            raise Cancelled(why)
        time.sleep(min(0.02, left))


def _dying(emit: Emit, round_: int) -> Emit:
    """``emit`` that sends one piece and then fails the round (the pieces before it are on their way)."""
    sent = []

    def once(piece: CompressedGradient) -> None:
        if sent:
            raise ConnectionAbortedError(f"round {round_}: the worker died mid-stream (fault injection)")
        sent.append(piece)
        emit(piece)

    return once


def _with_first(gradient: CompressedGradient, first: object, rest: list) -> CompressedGradient:
    return dataclasses.replace(gradient, tensors=(first, *rest))


def faulty(action: str, *, factor: float = 1000.0, rounds: Collection[int] | None = None) -> Callable[[], FaultyEngine]:
    """An engine factory: a CPU worker that misbehaves as told."""
    plan = FaultPlan(action, factor, rounds)
    return lambda: FaultyEngine(plan)


def supervise(
    command: Sequence[str], out: Path, kills: int, rng: random.Random, rounds_apart: int, env: Mapping[str, str]
) -> list[str]:
    """A supervisor loop around a coordinator: run ``command`` (which trains into ``out``) again each time it
    is SIGKILLed, ``kills`` times, each kill at a random point (after up to ``rounds_apart`` new metrics lines,
    then up to 0.25 s more: inside a round, an append or a checkpoint); then let it finish, which it must with
    exit code 0. Returns what each killed process wrote to stderr."""
    metrics, logs, starts = out / "metrics.jsonl", [], 0
    while True:
        starts += 1
        assert starts <= kills + 2, "the supervisor loop did not finish"
        before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        if len(logs) < kills:
            deadline, kill_after = time.monotonic() + 120, before + rng.randrange(rounds_apart)
            while proc.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) > kill_after
            ):
                assert time.monotonic() < deadline, "the run never got going"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.25))
            if proc.poll() is None:
                proc.kill()
                logs.append(proc.communicate(timeout=60)[1])
                continue
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        return logs
