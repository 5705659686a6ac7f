"""Bounded, validated input: what crosses the wire is sized before it is held or built, every float is
finite and in range, and a refused request leaves the worker as it was (INVALID_ARGUMENT, never INTERNAL).
"""

from __future__ import annotations

import dataclasses
import json

import grpc
import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.models import build_from_spec, model_spec, spec_elements
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, LocalSteps, ModelState, WorkOrder
from gradwire.replica import Replica, StateUpdate
from gradwire.security import run_owner
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker import engine as engine_module
from gradwire.worker import session as session_module
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.server import make_server
from gradwire.worker.servicer import WorkerServicer

SPEC = model_spec("gpt-tiny")
RULE = UpdateRule(optimizer="sgd")
RUN = "bounded"
TIMEOUT = 30.0


@pytest.fixture
def worker():
    engine = WorkerEngine("cpu", max_model_params=2 * spec_elements(SPEC))
    server, port, _ = make_server(WorkerServicer(engine), host="127.0.0.1", port=0)
    client = WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT)
    try:
        yield engine, client
    finally:
        client.close()
        server.stop(0).wait(5)


def state(**changes: object) -> ModelState:
    model = build_from_spec(SPEC, seed=0)
    good = ModelState(
        RUN, 0, json.dumps(SPEC), {n: p.detach().clone() for n, p in model.named_parameters()}, RULE.to_json()
    )
    return dataclasses.replace(good, **changes)


def order(replica: Replica, round: int, update: StateUpdate | None = None, base: int | None = None) -> WorkOrder:
    batch = np.random.default_rng(round).integers(0, 8192, (2, 17)).astype(np.uint16)
    return WorkOrder(
        RUN, round, replica.version if base is None else base, batch, CodecConfig(), replica.fingerprint(), update
    )


def refused(call, match: str) -> None:
    with pytest.raises(WorkerError) as info:
        call()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert match in info.value.details, info.value.details


def nan_in(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(iter(tensors))
    bad = dict(tensors)
    bad[name] = tensors[name].clone()
    bad[name].view(-1)[3] = float("nan")
    return bad


def test_bad_states_are_refused_and_the_live_run_is_untouched(worker) -> None:
    engine, client = worker
    client.push_state(state())
    session = engine.sessions[RUN]
    replica = Replica(build_from_spec(SPEC, seed=0), RULE)
    first, _ = client.run_round(order(replica, 1))  # the session now has error feedback
    payload = first.gradient
    feedback = {k: v.clone() for k, v in session.feedback.state_dict().items()}
    before = session.replica.fingerprint()
    params = state().parameters
    cases = {
        "non-finite feedback": (state(feedback=nan_in(feedback)), "feedback: tensor"),
        "non-finite parameters": (state(parameters=nan_in(params)), "parameters: tensor"),
        "infinite momentum": (state(optimizer_state={"momentum.0": torch.full((3,), float("inf"))}), "optimizer_state"),
        "null model": (state(model_json="null"), "must be a JSON object"),
        "list model": (state(model_json="[1, 2]"), "must be a JSON object"),
        "extra parameter": (state(parameters={**params, "evil.weight": torch.zeros(4)}), "the model does not"),
        "nan learning rate in the rule": (
            state(update_rule_json='{"optimizer": "sgd", "weight_decay": NaN}'),
            "weight-decay",
        ),
        "a learning-rate factor for a parameter the model lacks": (
            state(update_rule_json='{"optimizer": "signsgd", "lr_scales": [["evil.weight", 2.0]]}'),
            "does not have",
        ),
        "a learning-rate factor of zero": (
            state(update_rule_json='{"optimizer": "signsgd", "lr_scales": [["tok_emb.weight", 0]]}'),
            "factor",
        ),
    }
    for name, (bad, match) in cases.items():
        refused(lambda b=bad: client.push_state(b), match)
        assert engine.sessions[RUN] is session, name
    assert session.replica.fingerprint() == before
    for k, v in session.feedback.state_dict().items():
        assert torch.equal(v, feedback[k])
    # The run carries on: the next order (with last round's update) is served as if nothing happened.
    update = StateUpdate(0.1, (payload,), (1.0,))
    result, _ = client.run_round(order(replica, 2, update, base=0))
    assert result.status == OK


@pytest.mark.parametrize(
    ("learning_rate", "weights", "match"),
    [
        (float("nan"), (1.0,), "learning_rate"),
        (float("inf"), (1.0,), "learning_rate"),
        (1e308, (1.0,), "learning_rate"),
        (-0.1, (1.0,), "learning_rate"),
        (0.1, (float("nan"),), "replay weights"),
        (0.1, (0.0,), "not all be zero"),
        (0.1, (-1.0,), "replay weights"),
        (1e6, (1.0,), "refused, nothing changed"),  # in range, but the step would blow the replica up
    ],
)
def test_bad_updates_are_refused_before_anything_moves(
    worker, learning_rate: float, weights: tuple[float, ...], match: str
) -> None:
    engine, client = worker
    client.push_state(state())
    replica = Replica(build_from_spec(SPEC, seed=0), RULE)
    first, _ = client.run_round(order(replica, 1))
    payload = first.gradient
    if match == "refused, nothing changed":  # a real payload made huge: values at the codec's own limit
        t = payload.tensors[0]
        payload = dataclasses.replace(payload, tensors=(dataclasses.replace(t, scale=1e20), *payload.tensors[1:]))
    session = engine.sessions[RUN]
    before = session.replica.fingerprint()
    bad = StateUpdate(learning_rate, (payload,), weights)
    refused(lambda: client.run_round(order(replica, 2, bad, base=0)), match)
    assert session.replica.version == 0 and session.replica.fingerprint() == before
    result, _ = client.run_round(order(replica, 3))
    assert result.status == OK


def test_a_model_over_max_model_params_is_refused_before_it_is_built(worker, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, client = worker
    built = []
    monkeypatch.setattr(
        session_module, "build_from_spec", lambda spec, seed=0: built.append(spec) or build_from_spec(spec, seed)
    )
    big = model_spec("gpt-10m")  # 29M parameters, the worker takes 1.2M
    refused(lambda: client.push_state(state(model_json=json.dumps(big))), "--max-model-params")
    absurd = {"arch": "gpt", "config": {**SPEC["config"], "n_layer": 10**9}}
    refused(lambda: client.push_state(state(model_json=json.dumps(absurd))), "more than 1024")
    huge_vocab = {"arch": "gpt", "config": {**SPEC["config"], "vocab_size": 10**12}}
    refused(lambda: client.push_state(state(model_json=json.dumps(huge_vocab))), "beyond any model's size")
    assert built == [] and engine.sessions == {}
    client.push_state(state())
    assert list(engine.sessions) == [RUN]


def test_a_stream_declaring_more_than_the_runs_model_is_refused_on_its_first_part(worker) -> None:
    engine, client = worker
    client.push_state(state())
    limit = engine.request_limit(run_owner(b"", client.security.run_key), "state")
    elements = sum(engine.sessions[RUN].replica.numels)
    assert limit == 4 * elements * engine_module.STATE_COPIES + engine_module.REQUEST_SLACK
    sent = []

    def parts():
        sent.append(1)
        yield pb.Part(data=b"\0" * 1024, total_bytes=limit + 1)
        sent.append(2)  # never asked for
        yield pb.Part(data=b"\0", total_bytes=limit + 1)

    stub = worker_pb2_grpc.WorkerStub(client.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.PushState(parts(), timeout=TIMEOUT, metadata=client.call_metadata)
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "multiple of the run's model size" in info.value.details()
    )
    # A caller with no run here is held to --max-model-params instead: a declared-huge stream is refused too.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.RunRound(iter([pb.Part(data=b"x", total_bytes=1 << 40)]), timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-model-params" in info.value.details()
    assert list(engine.sessions) == [RUN]


def test_spec_elements_counts_without_allocating() -> None:
    model = build_from_spec(SPEC)
    assert spec_elements(SPEC) == sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert spec_elements(model_spec("opt-125m")) > 125_000_000
    with pytest.raises(ValueError, match="config"):
        spec_elements({"arch": "gpt", "config": None})


def test_protocol_refuses_non_finite_fingerprints() -> None:
    with pytest.raises(protocol.ProtocolError, match="fingerprint"):
        protocol.fingerprint_from_proto(pb.Fingerprint(sums=[1.0, float("nan")], sumsqs=[1.0, 1.0], samples=[]))


def test_run_ids_are_short_and_printable_and_never_echoed_whole(worker) -> None:
    engine, client = worker
    long_id = "x" * 100_000
    refused(
        lambda: client.push_state(state(run_id=long_id)),
        "run_id must be 1-128 printable ASCII characters (got 100000 characters)",
    )
    refused(lambda: client.push_state(state(run_id="bad\nid")), "printable")
    refused(lambda: client.fetch_worker_state(long_id), "run_id must be")
    assert engine.sessions == {}


def test_unparseable_requests_are_invalid_not_internal(worker) -> None:
    _, client = worker
    raw = client.channel.unary_unary(
        "/gradwire.v1.Worker/Describe", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff", timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in info.value.details()
    stream = client.channel.stream_stream(
        "/gradwire.v1.Worker/RunRound", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([b"\xff\xff\xff"]), timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in info.value.details()
    assert client.describe().device == "cpu"


def test_inner_learning_rates_for_parameters_the_model_lacks_are_refused_before_anything_moves(worker) -> None:
    engine, client = worker
    client.push_state(state())
    replica = Replica(build_from_spec(SPEC, seed=0), RULE)
    scaled = InnerOptimizerConfig(lr_scales=(("tok_emb.weight", 2.0),))

    def local(config: InnerOptimizerConfig, round: int) -> WorkOrder:
        return dataclasses.replace(order(replica, round), local_steps=LocalSteps(2, config, (1e-3, 1e-3)))

    session = engine.sessions[RUN]
    before = session.replica.fingerprint()
    evil = dataclasses.replace(scaled, lr_scales=(("tok_emb.weight", 2.0), ("evil.weight", 2.0)))
    refused(lambda: client.run_round(local(evil, 1)), "the model does not have: ['evil.weight']")
    assert session.replica.version == 0 and session.replica.fingerprint() == before
    assert session.inner_state() == {}  # no inner optimizer was built for it
    result, _ = client.run_round(local(scaled, 2))
    assert result.status == OK
