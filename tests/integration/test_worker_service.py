"""The Worker service end to end: a real server on port 0 in this process, the coordinator's WorkerClient.

Rounds keep the worker's replica in step with the coordinator's; any bad request is answered with a
status and the same server then serves a normal round; calls need deadlines; cancelled rounds stop;
health and SIGTERM behave. Every call has a deadline, so every test is bounded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradwire import protocol, statestream
from gradwire.compression import CodecConfig, GradientCodec
from gradwire.coordinator import client as client_module
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.errors import Cancelled
from gradwire.models import build_from_spec, model_spec
from gradwire.models import lm_loss as real_lm_loss
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import BEHIND, NEEDS_STATE, OK, LocalSteps, ModelState, RoundResult, WorkOrder
from gradwire.replica import Fingerprint, Replica, StateUpdate
from gradwire.transport import free_port
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker import cli
from gradwire.worker import compute as compute_module
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.server import make_server
from gradwire.worker.servicer import WorkerServicer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPEC = model_spec("gpt-tiny")
RULE = UpdateRule(optimizer="sgd")
RUN = "t1"
TIMEOUT = 20.0  # per call; a healthy call here takes well under a second


class SpyEngine(WorkerEngine):
    """A WorkerEngine that records which rounds it abandoned because the call was cancelled."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.cancelled_rounds: list[int] = []

    def run_round(self, order: WorkOrder, cancelled=lambda: False, owner: bytes = b"", emit=None) -> RoundResult:
        try:
            return super().run_round(order, cancelled, owner, emit)
        except Cancelled:
            self.cancelled_rounds.append(order.round)
            raise


@dataclasses.dataclass
class Worker:
    engine: SpyEngine
    server: grpc.Server
    port: int
    client: WorkerClient

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def worker() -> Iterator[Worker]:
    engine = SpyEngine()
    server, port, _health = make_server(WorkerServicer(engine), host="127.0.0.1", port=0, max_workers=4)
    client = WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT)
    try:
        yield Worker(engine, server, port, client)
    finally:
        client.close()
        server.stop(0).wait(5)


@pytest.fixture
def replica() -> Replica:
    """The coordinator's replica of run t1, at version 0."""
    return Replica(build_from_spec(SPEC, seed=0), RULE)


def state_of(replica: Replica) -> ModelState:
    params = {n: p.detach().clone() for n, p in replica.model.named_parameters()}
    return ModelState(RUN, replica.version, json.dumps(SPEC), params, RULE.to_json())


def make_order(
    replica: Replica,
    round: int,
    base_version: int,
    update: StateUpdate | None = None,
    *,
    rows: int = 2,
    columns: int = 17,
    micro_batch_size: int = 0,
    fingerprint: Fingerprint | None = None,
) -> WorkOrder:
    batch = np.random.default_rng(round).integers(0, 8192, (rows, columns)).astype(np.uint16)
    return WorkOrder(
        RUN,
        round,
        base_version,
        batch,
        CodecConfig(),
        fingerprint or replica.fingerprint(),
        update,
        micro_batch_size=micro_batch_size,
    )


def codec_for(replica: Replica) -> GradientCodec:
    return GradientCodec({n: tuple(p.shape) for n, p in replica.params.items()}, CodecConfig())


def assert_round_ok(worker: Worker, replica: Replica, round: int = 99) -> RoundResult:
    """A plain round at the replica's version succeeds: the server is still healthy."""
    result, _ = worker.client.run_round(make_order(replica, round, replica.version))
    assert (result.status, result.version, result.reason) == (OK, replica.version, "")
    return result


def assert_rpc_error(call, code: grpc.StatusCode, match: str = "") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    return info.value


def raw_round(worker: Worker, parts: list[pb.Part], timeout: float | None = TIMEOUT) -> bytes:
    """RunRound with hand-made parts; returns the reply's bytes."""
    stub = worker_pb2_grpc.WorkerStub(worker.client.channel)
    return protocol.join_parts(
        stub.RunRound(iter(parts), timeout=timeout, metadata=worker.client.call_metadata), 1 << 30
    )


# ------------------------------------------------------------------------------------------- rounds


def test_health_is_serving_after_start(worker: Worker) -> None:
    health = health_pb2_grpc.HealthStub(worker.client.channel)
    for service in ("", "gradwire.v1.Worker"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    worker.client.wait_ready(timeout=TIMEOUT)


def test_describe(worker: Worker) -> None:
    info = worker.client.describe()
    assert (info.protocol_version, info.device, info.replicas) == (protocol.PROTOCOL_VERSION, "cpu", {})


def test_rounds_keep_the_replicas_in_step(worker: Worker, replica: Replica) -> None:
    client = worker.client
    (version, fp), pushed = client.push_state(state_of(replica))
    assert (version, fp) == (0, replica.fingerprint())
    assert pushed.down > 4 * sum(replica.numels)  # the whole model went down
    assert client.describe().replicas == {RUN: 0}

    first, traffic = client.run_round(make_order(replica, 0, 0))
    assert (first.status, first.round, first.version, first.tokens) == (OK, 0, 0, 32)
    assert abs(first.loss - math.log(8192)) < 0.5  # a fresh model is about uniform over the vocabulary
    # the first round here waited for nothing: a zero field is left off the wire
    assert set(first.timings) == {"update", "compute", "compress", "total", "wall"}
    assert first.timings["wall"] == first.timings["total"]
    codec_for(replica).decode(first.gradient)  # valid against the coordinator's own plan
    assert traffic.down > 2 * 17 * 2 and traffic.up >= first.gradient.nbytes

    # The next order carries round 0's update and the fingerprint of the version it starts from; the
    # worker checks, replays the update and lands on the same replica as the coordinator's copy.
    update = StateUpdate(learning_rate=0.1, payloads=(first.gradient,), weights=(1.0,))
    base = replica.fingerprint()
    replica.apply(update)
    second, _ = client.run_round(make_order(replica, 1, 0, update, fingerprint=base))
    assert (second.status, second.version) == (OK, 1), second.reason
    assert client.describe().replicas == {RUN: 1}
    with worker.engine._lock:
        assert worker.engine.sessions[RUN].replica.fingerprint() == replica.fingerprint()

    state, _ = client.fetch_worker_state(RUN)
    assert (state.run_id, state.version) == (RUN, 1)
    assert state.feedback and all(b.isfinite().all() for b in state.feedback.values())
    assert state.inner_optimizer == {}  # no local-SGD round yet


def test_needs_state_until_the_state_is_pushed_again(worker: Worker, replica: Replica) -> None:
    client = worker.client
    missing, _ = client.run_round(make_order(replica, 0, 0))
    assert missing.status == NEEDS_STATE and "no replica" in missing.reason

    client.push_state(state_of(replica))
    fp = replica.fingerprint()
    perturbed = dataclasses.replace(fp, sumsqs=(fp.sumsqs[0] * 1.01, *fp.sumsqs[1:]))
    result, _ = client.run_round(make_order(replica, 1, 0, fingerprint=perturbed))
    assert (result.status, result.gradient) == (NEEDS_STATE, None) and "fingerprint" in result.reason
    # A replica found out of sync stays untrusted, even for a correct order, until the next push.
    again, _ = client.run_round(make_order(replica, 2, 0))
    assert again.status == NEEDS_STATE
    client.push_state(state_of(replica))
    assert_round_ok(worker, replica)


def test_a_perturbed_worker_replica_needs_state(worker: Worker, replica: Replica) -> None:
    worker.client.push_state(state_of(replica))
    with worker.engine._lock, torch.no_grad():  # an in-place write, as any change of a parameter is
        next(iter(worker.engine.sessions[RUN].replica.params.values()))[0, 0] += 1.0
    result, _ = worker.client.run_round(make_order(replica, 0, 0))
    assert result.status == NEEDS_STATE and "fingerprint" in result.reason
    worker.client.push_state(state_of(replica))
    assert_round_ok(worker, replica)


def test_an_order_for_another_version_is_behind_and_the_replica_stays_usable(worker: Worker, replica: Replica) -> None:
    worker.client.push_state(state_of(replica))
    result, _ = worker.client.run_round(make_order(replica, 0, 5))
    assert (result.status, result.version) == (BEHIND, 0) and "version" in result.reason
    assert_round_ok(worker, replica)  # not marked stale: a sound replica at another version may catch up


def test_catch_up_replays_missed_updates_before_the_rounds_update(worker: Worker, replica: Replica) -> None:
    """A worker at version 0 gets the updates 0->1 and 1->2 in one order and ends where the coordinator is."""
    worker.client.push_state(state_of(replica))
    coordinator = Replica(build_from_spec(SPEC, seed=0), RULE)
    updates, fingerprints = [], []
    for _ in range(3):  # three rounds' updates, made from the coordinator's own gradients
        payload = codec_for(coordinator).compress(
            {n: torch.randn_like(p) * 1e-2 for n, p in coordinator.params.items()}
        )
        fingerprints.append(coordinator.fingerprint())
        updates.append(StateUpdate(0.1, (payload,), (1.0,)))
        coordinator.apply(updates[-1])
    order = dataclasses.replace(
        make_order(replica, 7, 0, updates[2], fingerprint=fingerprints[0]), catch_up=tuple(updates[:2])
    )
    result, _ = worker.client.run_round(order)
    assert (result.status, result.version) == (OK, 3)
    (session,) = worker.engine.sessions.values()
    for name, p in coordinator.params.items():
        assert torch.equal(session.replica.params[name], p), name


# ------------------------------------------------------------------------------------------- bad requests


def order_parts(order: WorkOrder | pb.WorkOrder, part_bytes: int = protocol.PART_BYTES) -> list[pb.Part]:
    msg = order if isinstance(order, pb.WorkOrder) else protocol.order_to_proto(order)
    return list(protocol.to_parts(msg, part_bytes))


def frame(data: bytes) -> list[pb.Part]:
    """Correctly framed bytes that are not a message."""
    return [pb.Part(data=data, last=True, total_bytes=len(data), sha256=hashlib.sha256(data).digest())]


def _wrong_sha(parts: list[pb.Part]) -> list[pb.Part]:
    last = pb.Part()
    last.CopyFrom(parts[-1])
    last.sha256 = bytes(32)
    return [*parts[:-1], last]


def _mangled(order: WorkOrder, mangle) -> pb.WorkOrder:
    msg = protocol.order_to_proto(order)
    mangle(msg)
    return msg


BAD_ROUNDS = {
    # name: (parts from a valid order, expected message)
    "garbage-part": (lambda o: [pb.Part(data=os.urandom(64))], "runs past the 0 bytes its parts declare"),
    "declared-huge": (lambda o: [pb.Part(data=b"x", total_bytes=1 << 40)], "over the"),
    "parts-disagree-on-total": (lambda o: [order_parts(o, 64)[0], pb.Part(data=b"x", total_bytes=5)], "the first part"),
    "runs-past-declared": (lambda o: [pb.Part(data=b"x" * 64, total_bytes=10)], "runs past"),
    "garbage-last-part": (lambda o: [pb.Part(data=b"junk", last=True, total_bytes=4, sha256=b"nope")], "SHA-256"),
    "no-parts": (lambda o: [], "ended before its last part"),
    "short-of-declared": (
        lambda o: [pb.Part(data=b"x", total_bytes=10, last=True, sha256=hashlib.sha256(b"x").digest())],
        "declare 10",
    ),
    "truncated": (lambda o: order_parts(o, 64)[:-1], "ended before its last part"),
    "wrong-sha": (lambda o: _wrong_sha(order_parts(o, 64)), "SHA-256"),
    "framed-garbage": (lambda o: frame(b"\xff" * 32), "not a WorkOrder"),
    "foreign-protocol-version": (
        lambda o: order_parts(_mangled(o, lambda m: setattr(m, "protocol_version", protocol.PROTOCOL_VERSION + 1))),
        "protocol version",
    ),
    "bad-batch-bytes": (lambda o: order_parts(_mangled(o, lambda m: setattr(m.batch, "rows", 3))), "does not match"),
    "token-out-of-vocabulary": (
        lambda o: order_parts(dataclasses.replace(o, batch=np.full((2, 5), 9000, np.uint16))),
        "token id",
    ),
    "sequence-too-long": (
        lambda o: order_parts(dataclasses.replace(o, batch=np.zeros((1, 500), np.uint16))),
        "max_seq_len",
    ),
    "codec-settings": (lambda o: order_parts(_mangled(o, lambda m: setattr(m.codec, "topk", 0))), "codec settings"),
    "local-steps-uneven-batch": (
        lambda o: order_parts(dataclasses.replace(o, local_steps=LocalSteps(3, InnerOptimizerConfig(), (1e-3,) * 3))),
        "does not split",
    ),
    "local-steps-bad-optimizer": (
        lambda o: order_parts(
            _mangled(
                dataclasses.replace(o, local_steps=LocalSteps(2, InnerOptimizerConfig(), (1e-3,) * 2)),
                lambda m: setattr(m.local_steps.optimizer, "name", "lion"),
            )
        ),
        "inner optimizer",
    ),
    "local-steps-nan-lr": (
        lambda o: order_parts(
            _mangled(
                dataclasses.replace(o, local_steps=LocalSteps(2, InnerOptimizerConfig(), (1e-3,) * 2)),
                lambda m: m.local_steps.learning_rates.__setitem__(0, float("nan")),
            )
        ),
        "finite",
    ),
}


@pytest.mark.parametrize("name", list(BAD_ROUNDS))
def test_bad_round_requests_are_invalid_and_the_server_carries_on(worker: Worker, replica: Replica, name: str) -> None:
    worker.client.push_state(state_of(replica))
    make_parts, message = BAD_ROUNDS[name]
    parts = make_parts(make_order(replica, 0, 0))
    assert_rpc_error(lambda: raw_round(worker, parts), grpc.StatusCode.INVALID_ARGUMENT, message)
    assert_round_ok(worker, replica)


def test_an_update_whose_payload_has_wrong_shapes_is_invalid_and_changes_nothing(
    worker: Worker, replica: Replica
) -> None:
    worker.client.push_state(state_of(replica))
    first, _ = worker.client.run_round(make_order(replica, 0, 0))
    gradient = first.gradient
    t = gradient.tensors[0]
    bad = dataclasses.replace(
        gradient, tensors=(dataclasses.replace(t, shape=tuple(s + 1 for s in t.shape)), *gradient.tensors[1:])
    )
    update = StateUpdate(0.1, (bad,), (1.0,))
    with pytest.raises(WorkerError) as info:
        worker.client.run_round(make_order(replica, 1, 0, update))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "shape" in info.value.details
    assert worker.client.describe().replicas == {RUN: 0}
    assert_round_ok(worker, replica)


def test_bad_pushes_are_invalid_and_the_server_carries_on(worker: Worker, replica: Replica) -> None:
    stub = worker_pb2_grpc.WorkerStub(worker.client.channel)
    good = state_of(replica)
    wrong_shape = dataclasses.replace(
        good, parameters={**good.parameters, "tok_emb.weight": good.parameters["tok_emb.weight"][:10]}
    )
    cases = [
        (dataclasses.replace(good, model_json="{not json"), "model state"),
        (dataclasses.replace(good, update_rule_json='{"optimizer": "lion"}'), "model state"),
        (wrong_shape, "shape"),
        (dataclasses.replace(good, protocol_version=protocol.PROTOCOL_VERSION + 1), "protocol version"),
    ]
    for state, message in cases:
        parts = iter(statestream.state_parts(state))
        assert_rpc_error(
            lambda parts=parts: stub.PushState(parts, timeout=TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT, message
        )
    assert_rpc_error(
        lambda: stub.PushState(iter([pb.Part(data=b"\xff")]), timeout=TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
        "runs past the 0 bytes",
    )
    # protobuf's own order puts the update rule after the parameters: a worker streams the state, and says
    # why it cannot take that order.
    assert_rpc_error(
        lambda: stub.PushState(iter(protocol.to_parts(protocol.state_to_proto(good))), timeout=TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
        "before its tensors",
    )
    worker.client.push_state(good)
    mine = worker.client.call_metadata  # the run's owner
    # A new version whose stream fails its hash after every tensor was loaded replaces nothing.
    newer = dataclasses.replace(good, version=7, parameters={n: t + 1 for n, t in good.parameters.items()})
    *parts, last = statestream.state_parts(newer, part_bytes=64 << 10)
    broken = [*parts, pb.Part(data=last.data, last=True, total_bytes=last.total_bytes, sha256=bytes(32))]
    assert_rpc_error(
        lambda: stub.PushState(iter(broken), timeout=TIMEOUT, metadata=mine),
        grpc.StatusCode.INVALID_ARGUMENT,
        "SHA-256",
    )
    assert worker.client.describe().replicas == {RUN: 0}
    assert_round_ok(worker, replica)
    cut = list(statestream.state_parts(newer, part_bytes=64 << 10))[:-1]  # the stream ends early
    assert_rpc_error(
        lambda: stub.PushState(iter(cut), timeout=TIMEOUT, metadata=mine), grpc.StatusCode.INVALID_ARGUMENT, "ended"
    )
    assert worker.client.describe().replicas == {RUN: 0}
    assert_round_ok(worker, replica)


def test_a_push_that_stalls_half_way_holds_up_no_round(worker: Worker, replica: Replica) -> None:
    # A push is read as it arrives, off the thread that computes: a caller that stops sending half way
    # (slow, or hostile) delays no round, and its push, once it gives up, replaces nothing.
    worker.client.push_state(state_of(replica))
    newer = dataclasses.replace(state_of(replica), version=3)
    parts = list(statestream.state_parts(newer, part_bytes=64 << 10))
    resume = threading.Event()

    def stalling() -> Iterator[pb.Part]:
        yield from parts[: len(parts) // 2]
        resume.wait(TIMEOUT)  # then the stream ends without its last part

    stub = worker_pb2_grpc.WorkerStub(worker.client.channel)
    call = stub.PushState.future(stalling(), timeout=TIMEOUT, metadata=worker.client.call_metadata)
    try:
        time.sleep(0.5)  # the push has begun: its session is being built
        assert not call.done()
        assert_round_ok(worker, replica)
    finally:
        resume.set()
    with pytest.raises(grpc.RpcError) as info:
        call.result()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended" in info.value.details()
    assert worker.client.describe().replicas == {RUN: 0}


def test_a_message_over_the_size_limit_is_invalid() -> None:
    engine = WorkerEngine("cpu")
    server, port, _ = make_server(WorkerServicer(engine, max_message_mb=4), host="127.0.0.1", port=0)
    try:
        with WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT, max_message_mb=4) as client:
            replica = Replica(build_from_spec(SPEC, seed=0), RULE)
            big = dataclasses.replace(state_of(replica), feedback={"x": torch.zeros(2 << 20)})  # 8 MiB
            with pytest.raises(WorkerError) as info:
                client.push_state(big)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-message-mb" in info.value.details
            client.push_state(state_of(replica))  # ~2.5 MB: fits
    finally:
        server.stop(0).wait(5)


def test_fetch_worker_state_of_an_unknown_run_is_invalid(worker: Worker) -> None:
    with pytest.raises(WorkerError) as info:
        worker.client.fetch_worker_state("nope")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no replica" in info.value.details


def test_a_diverged_round_fails_precondition_resets_the_feedback_and_the_server_carries_on(
    worker: Worker, replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker.client.push_state(state_of(replica))
    first = assert_round_ok(worker, replica, round=0)  # leaves error feedback behind
    assert worker.engine.sessions[RUN].feedback.buffers
    # The worker's loss turns NaN (a run whose learning rate is too high): so does every gradient.
    monkeypatch.setattr(compute_module, "lm_loss", lambda model, tokens: real_lm_loss(model, tokens) * math.nan)
    with pytest.raises(WorkerError) as info:
        worker.client.run_round(make_order(replica, 1, replica.version))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "diverged" in info.value.details, info.value
    assert worker.engine.sessions[RUN].feedback.buffers == {}  # the NaN it took in is gone
    monkeypatch.undo()
    # The replica never moved: the next round at the same version serves, with fresh feedback.
    again = assert_round_ok(worker, replica, round=0)
    assert again.gradient == first.gradient  # the same batch, no feedback either time


def test_an_engine_bug_is_internal_and_the_server_carries_on(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker.engine, "info", lambda owner=None: 1 / 0)
    with pytest.raises(WorkerError) as info:
        worker.client.describe()
    assert info.value.code == grpc.StatusCode.INTERNAL and "ZeroDivisionError" in info.value.details
    monkeypatch.undo()
    assert worker.client.describe().device == "cpu"


# ------------------------------------------------------------------------------------------- deadlines, cancellation


def test_calls_without_a_deadline_are_refused(worker: Worker, replica: Replica) -> None:
    stub = worker_pb2_grpc.WorkerStub(worker.client.channel)
    assert_rpc_error(
        lambda: stub.Describe(pb.DescribeRequest()), grpc.StatusCode.INVALID_ARGUMENT, "every call needs a deadline"
    )
    parts = order_parts(make_order(replica, 0, 0))
    assert_rpc_error(
        lambda: raw_round(worker, parts, timeout=None), grpc.StatusCode.INVALID_ARGUMENT, "every call needs a deadline"
    )
    assert_rpc_error(
        lambda: list(stub.FetchWorkerState(pb.FetchWorkerStateRequest(run_id=RUN))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "deadline",
    )
    # Health checks are exempt: load balancers and probes rarely set one.
    health = health_pb2_grpc.HealthStub(worker.client.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert worker.engine.sessions == {}


def _long_order(replica: Replica) -> WorkOrder:
    # 2000 micro-batches of one 128-token row: far longer than the deadlines below, so only cancellation ends it.
    return make_order(replica, 7, 0, rows=2000, columns=129, micro_batch_size=1)


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_round_past_its_deadline_stops_on_the_worker(worker: Worker, replica: Replica) -> None:
    worker.client.push_state(state_of(replica))
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        worker.client.run_round(_long_order(replica), timeout=0.5)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    assert _wait_for(lambda: worker.engine.cancelled_rounds == [7]), (
        "the worker kept computing a round nobody waits for"
    )
    assert_round_ok(worker, replica)


def test_a_cancelled_round_stops_on_the_worker(worker: Worker, replica: Replica) -> None:
    worker.client.push_state(state_of(replica))
    stub = worker_pb2_grpc.WorkerStub(worker.client.channel)
    call = stub.RunRound(iter(order_parts(_long_order(replica))), timeout=TIMEOUT, metadata=worker.client.call_metadata)
    timer = threading.Timer(0.5, call.cancel)
    timer.start()
    try:
        assert_rpc_error(lambda: list(call), grpc.StatusCode.CANCELLED)
    finally:
        timer.cancel()
    assert _wait_for(lambda: worker.engine.cancelled_rounds == [7])
    assert_round_ok(worker, replica)


# ------------------------------------------------------------------------------------------- client and pool


def test_describe_refuses_another_protocol_version(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "PROTOCOL_VERSION", protocol.PROTOCOL_VERSION + 1)
    with pytest.raises(WorkerError, match="protocol") as info:
        worker.client.describe()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        str(info.value)
        == f"worker at {worker.address} speaks protocol {protocol.PROTOCOL_VERSION}, this coordinator speaks "
        f"{protocol.PROTOCOL_VERSION + 1}: upgrade the older one"
    )


def test_wait_ready_gives_up_on_a_dead_address() -> None:
    with WorkerClient(f"127.0.0.1:{free_port()}", timeout=1.0) as client:
        with pytest.raises(WorkerError, match="not reachable") as info:
            client.wait_ready(timeout=0.5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------------------------- the command


def test_help_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "--port" in out and "--device" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "0", "--device", "tpu"],
        ["serve", "--port", "0", "--device", "cuda:99"],
        ["serve", "--port", "-1"],
        ["serve", "--port", "0", "--max-message-mb", "1"],
        ["serve"],
        [],
        ["serve", "--port", "0", "--nproc-per-node", "0"],
        ["serve", "--port", "0", "--node-mode", "ring"],
        ["serve", "--port", "0", "--precision", "fp8"],
        ["serve", "--port", "0", "--node-comm-hook", "zip"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    if argv[-2:] == ["--device", "tpu"]:
        assert "--device" in capsys.readouterr().err


def test_a_busy_port_is_an_error(worker: Worker, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(OSError, match="--port"):
        make_server(WorkerServicer(WorkerEngine("cpu")), host="127.0.0.1", port=worker.port)
    assert cli.main(["serve", "--host", "127.0.0.1", "--port", str(worker.port), "--device", "cpu"]) == 1
    assert "cannot listen" in capsys.readouterr().err
    assert worker.client.describe().device == "cpu"


@pytest.mark.slow
def test_worker_process_serves_then_stops_on_sigterm(tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "worker.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradwire.worker",
            "serve",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with WorkerClient(f"127.0.0.1:{port}", timeout=5.0) as client:
            client.wait_ready(timeout=20.0)
            assert client.describe().device == "cpu"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        log.seek(0)
        output = log.read()
        log.close()
    assert f"worker listening on 127.0.0.1:{port}" in output, output
