"""gradwire/protocol.py: framing checks size, completeness and hash; every message survives its serde;
malformed or foreign-version input raises ProtocolError (or the codec's PayloadError), both ValueErrors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, CompressedGradient, GradientCodec, PayloadError
from gradwire.compression.fragment import Fragment
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.protocol import (
    PROTOCOL_VERSION,
    LocalSteps,
    ModelState,
    ProtocolError,
    RoundResult,
    WorkerInfo,
    WorkerState,
    WorkOrder,
)
from gradwire.replica import Fingerprint, StateUpdate
from gradwire.v1 import worker_pb2 as pb

SHAPES = {"w": (64, 64), "b": (16,)}


@pytest.fixture(scope="module")
def gradient() -> CompressedGradient:
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    return GradientCodec(SHAPES, CodecConfig(chunk=16, topk=8)).compress(grads)


def fingerprint() -> Fingerprint:
    return Fingerprint((1.5, -2.0), (3.0, 4.0), (0.25, -0.5, 1.0))


def order(**changes: object) -> WorkOrder:
    batch = np.arange(2 * 9, dtype=np.uint16).reshape(2, 9)
    return dataclasses.replace(WorkOrder("run", 3, 7, batch, CodecConfig(chunk=16, topk=8), fingerprint()), **changes)


# ------------------------------------------------------------------------------------------- framing


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 1000])
def test_parts_round_trip(size: int) -> None:
    msg = pb.FetchWorkerStateRequest(run_id="x" * size)
    parts = list(protocol.to_parts(msg, part_bytes=100))
    data = msg.SerializeToString()
    assert len(parts) == max(1, math.ceil(len(data) / 100))
    assert [p.last for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].total_bytes == len(data) and parts[-1].sha256 == hashlib.sha256(data).digest()
    assert protocol.join_parts(parts, max_bytes=1 << 20) == data
    assert protocol.parse(pb.FetchWorkerStateRequest, protocol.join_parts(parts, 1 << 20)) == msg


def framed(data: bytes) -> list[pb.Part]:
    half, total = len(data) // 2, len(data)
    return [
        pb.Part(data=data[:half], total_bytes=total),
        pb.Part(data=data[half:], last=True, total_bytes=total, sha256=hashlib.sha256(data).digest()),
    ]


def _with_total(part: pb.Part, total: int) -> pb.Part:
    out = pb.Part()
    out.CopyFrom(part)
    out.total_bytes = total
    return out


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda ps: ps[:-1], "ended before its last part"),
        (lambda ps: [], "ended before its last part"),
        (lambda ps: [ps[0], _with_total(ps[1], 201)], "a part declares 201 bytes in all, the first part 200"),
        (
            lambda ps: [_with_total(ps[0], 201), _with_total(ps[1], 201)],
            "framed message is 200 bytes, its parts declare 201",
        ),
        (
            lambda ps: [ps[0], pb.Part(data=ps[1].data, last=True, total_bytes=ps[1].total_bytes, sha256=b"\0" * 32)],
            "SHA-256",
        ),
        (lambda ps: [pb.Part(data=b"x" + ps[0].data, total_bytes=200), ps[1]], "runs past the 200 bytes"),
        (lambda ps: [pb.Part(data=bytes([ps[0].data[0] ^ 1]) + ps[0].data[1:], total_bytes=200), ps[1]], "SHA-256"),
        (
            lambda ps: [pb.Part(data=ps[0].data), ps[1]],
            "runs past the 0 bytes",
        ),  # protocol 2 framing: no total up front
    ],
    ids=[
        "no-last-part",
        "empty-stream",
        "totals-disagree",
        "short-of-total",
        "wrong-hash",
        "extra-byte",
        "flipped-bit",
        "no-total-first",
    ],
)
def test_join_parts_rejects_broken_frames(mangle, message: str) -> None:
    parts = mangle(framed(bytes(range(200))))
    with pytest.raises(ProtocolError, match=message):
        protocol.join_parts(parts, max_bytes=1 << 20)


def test_every_part_declares_the_total() -> None:
    msg = pb.FetchWorkerStateRequest(run_id="y" * 1000)
    parts = list(protocol.to_parts(msg, part_bytes=128))
    assert len(parts) > 2 and {p.total_bytes for p in parts} == {msg.ByteSize()}


def test_join_parts_refuses_a_declared_oversize_before_reading_on() -> None:
    consumed = []

    def huge():
        while True:
            consumed.append(1)
            yield pb.Part(data=b"\0" * 1024, total_bytes=1 << 40)

    with pytest.raises(
        ProtocolError, match=r"declares 1099511627776 bytes, over the 1.0 MiB limit \(--max-message-mb\)"
    ):
        protocol.join_parts(huge(), max_bytes=1 << 20)
    assert len(consumed) == 1  # one part looked at, none kept


def test_join_parts_stops_at_the_declared_size_when_parts_run_on() -> None:
    consumed = []

    def endless():
        while True:
            consumed.append(1)
            yield pb.Part(data=b"\0" * (1 << 18), total_bytes=1 << 20)

    with pytest.raises(ProtocolError, match="runs past the 1048576 bytes"):
        protocol.join_parts(endless(), max_bytes=1 << 20)
    assert len(consumed) == 5


@pytest.mark.parametrize(
    "data", [b"\xff" * 16, b"\x0f", b"\x0a\x05ab"], ids=["truncated-varint", "bad-wire-type", "short-field"]
)
def test_parse_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="not a WorkOrder"):
        protocol.parse(pb.WorkOrder, data)


# ------------------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4)])
def test_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 50).to(dtype)
    back = protocol.tensor_from_proto(protocol.tensor_to_proto("t", t))
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, t)


def test_tensor_non_contiguous_travels_as_row_major() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).T  # (3, 2), not contiguous
    assert torch.equal(protocol.tensor_from_proto(protocol.tensor_to_proto("t", t)), t)


def test_tensor_rejects_wrong_byte_count_and_unknown_dtype() -> None:
    msg = protocol.tensor_to_proto("t", torch.zeros(2, 3))
    msg.shape[:] = [2, 4]
    with pytest.raises(ProtocolError, match="'t': 24 bytes for shape"):
        protocol.tensor_from_proto(msg)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        protocol.tensor_from_proto(pb.Tensor(name="u", shape=[1], dtype=pb.DTYPE_UNSPECIFIED, data=b"\0" * 4))
    with pytest.raises(ProtocolError, match="cannot travel"):
        protocol.tensor_to_proto("c", torch.zeros(2, dtype=torch.complex64))


def test_tensors_reject_a_repeated_name() -> None:
    msgs = [protocol.tensor_to_proto("a", torch.zeros(1)), protocol.tensor_to_proto("a", torch.ones(1))]
    with pytest.raises(ProtocolError, match="twice"):
        protocol.tensors_from_proto(msgs)


# ------------------------------------------------------------------------------------------- messages


def test_info_round_trip() -> None:
    info = WorkerInfo(PROTOCOL_VERSION, "0.1.0", "2.5", "cuda:0", "H100", 8, {"a": 3, "b": 0})
    assert protocol.info_from_proto(protocol.info_to_proto(info)) == info
    bf16 = dataclasses.replace(info, precision="bf16")
    assert protocol.info_from_proto(protocol.info_to_proto(bf16)).precision == "bf16"


def test_a_workers_precision_is_fp32_unless_it_says_bf16() -> None:
    """An older worker says nothing (fp32); a precision a spot check could not recompute is refused."""
    msg = protocol.info_to_proto(WorkerInfo(PROTOCOL_VERSION, "0.1.0", "2.5", "cpu"))
    msg.precision = ""
    assert protocol.info_from_proto(msg).precision == "fp32"
    msg.precision = "fp8"
    with pytest.raises(ProtocolError, match="fp32 or bf16"):
        protocol.info_from_proto(msg)


def test_model_state_round_trip() -> None:
    state = ModelState(
        "run",
        5,
        '{"arch": "gpt"}',
        {"w": torch.randn(3, 4), "b": torch.randn(4).bfloat16()},
        '{"optimizer": "sgd"}',
        {"momentum.0": torch.randn(3, 4)},
        {"w": torch.randn(3, 4)},
        {"w/exp_avg": torch.randn(3, 4), "w/step": torch.tensor(2.0)},
    )
    back = protocol.state_from_proto(protocol.parse(pb.ModelState, protocol.state_to_proto(state).SerializeToString()))
    assert (back.run_id, back.version, back.model_json, back.update_rule_json) == (
        state.run_id,
        state.version,
        state.model_json,
        state.update_rule_json,
    )
    pairs = [
        (state.parameters, back.parameters),
        (state.optimizer_state, back.optimizer_state),
        (state.feedback, back.feedback),
        (state.inner_optimizer, back.inner_optimizer),
    ]
    for mine, theirs in pairs:
        assert list(mine) == list(theirs)  # order matters: named_parameters() order
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_model_state_checks_version_and_run_id() -> None:
    state = ModelState("run", 0, "{}", {}, "{}")
    with pytest.raises(ProtocolError, match="protocol version 99"):
        protocol.state_from_proto(protocol.state_to_proto(dataclasses.replace(state, protocol_version=99)))
    with pytest.raises(ProtocolError, match="no run_id"):
        protocol.state_from_proto(protocol.state_to_proto(dataclasses.replace(state, run_id="")))


def test_fingerprint_round_trip() -> None:
    assert protocol.fingerprint_from_proto(protocol.fingerprint_to_proto(fingerprint())) == fingerprint()


def assert_orders_equal(a: WorkOrder, b: WorkOrder) -> None:
    assert np.array_equal(a.batch, b.batch) and a.batch.dtype == b.batch.dtype
    assert dataclasses.replace(a, batch=None) == dataclasses.replace(b, batch=None)


def test_work_order_round_trip_without_update() -> None:
    o = order(feedback_beta=0.5, micro_batch_size=1, sync_tolerance=1e-3)
    msg = protocol.parse(pb.WorkOrder, protocol.order_to_proto(o).SerializeToString())
    assert not msg.HasField("update")
    assert_orders_equal(protocol.order_from_proto(msg), o)


def test_work_order_round_trip_with_replay_and_delta(gradient: CompressedGradient) -> None:
    for update in [StateUpdate(0.1, (gradient, gradient), (1.0, 3.0)), StateUpdate(0.01, delta=gradient)]:
        o = order(update=update)
        assert_orders_equal(protocol.order_from_proto(protocol.order_to_proto(o)), o)


def test_replay_update_with_default_weights_travels(gradient: CompressedGradient) -> None:
    # StateUpdate's weights default to () = equal weights, which Replica.apply accepts; the wire must too.
    back = protocol.update_from_proto(protocol.update_to_proto(StateUpdate(0.1, (gradient, gradient))))
    assert back.payloads == (gradient, gradient) and back.weights == (1.0, 1.0)


def test_work_order_int32_and_big_endian_batches() -> None:
    for batch in [np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(6, dtype=">u2").reshape(2, 3)]:
        back = protocol.order_from_proto(protocol.order_to_proto(order(batch=batch)))
        assert np.array_equal(back.batch, batch)


def test_order_to_proto_rejects_bad_batches() -> None:
    for batch in [np.zeros((2, 3), np.float32), np.zeros(6, np.uint16), np.zeros((1, 2, 3), np.int32)]:
        with pytest.raises(ProtocolError, match="token batch"):
            protocol.order_to_proto(order(batch=batch))


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda m: setattr(m, "protocol_version", PROTOCOL_VERSION + 1), "protocol version"),
        (lambda m: setattr(m, "run_id", ""), "no run_id"),
        (lambda m: setattr(m.batch, "rows", 3), "does not match"),
        (lambda m: setattr(m.batch, "columns", 1), "does not match"),
        (lambda m: setattr(m.batch, "dtype", pb.DTYPE_FLOAT32), "not uint16 or int32"),
        (lambda m: setattr(m, "feedback_beta", 1.5), "feedback_beta"),
        (lambda m: setattr(m, "feedback_beta", float("nan")), "feedback_beta"),
        (lambda m: setattr(m, "sync_tolerance", 1.0), "sync_tolerance"),
        (lambda m: setattr(m.codec, "topk", 0), "codec settings"),
        (lambda m: m.update.replay.weights.append(1.0), "payloads and"),
        (lambda m: m.update.ClearField("replay"), "neither a replay nor a delta"),
    ],
)
def test_order_from_proto_rejects(mangle, message: str, gradient: CompressedGradient) -> None:
    msg = protocol.order_to_proto(order(update=StateUpdate(0.1, (gradient,), (1.0,))))
    mangle(msg)
    with pytest.raises(ProtocolError, match=message):
        protocol.order_from_proto(msg)


def local(steps: int = 2, **changes: object) -> LocalSteps:
    base = dict(
        optimizer=InnerOptimizerConfig(name="adamw", weight_decay=0.1),
        learning_rates=(1e-3,) * steps,
        clip_grad_norm=1.0,
    )
    return LocalSteps(steps=steps, **{**base, **changes})


def test_work_order_with_local_steps_round_trips() -> None:
    for plan in (
        local(2),
        local(1, optimizer=InnerOptimizerConfig(name="muon", momentum=0.95)),
        local(2, optimizer=InnerOptimizerConfig(name="sgd", momentum=0.9, nesterov=True)),
        local(2, optimizer=InnerOptimizerConfig(lr_scales=(("tok_emb.weight", 2.0), ("head.weight", 0.5)))),
    ):
        o = order(local_steps=plan)
        back = protocol.order_from_proto(protocol.parse(pb.WorkOrder, protocol.order_to_proto(o).SerializeToString()))
        assert_orders_equal(back, o)
        assert back.inner_steps == plan.steps
    assert order().inner_steps == 1 and not protocol.order_to_proto(order()).HasField("local_steps")


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda m: setattr(m.local_steps, "steps", 0), "steps must be in"),
        (lambda m: setattr(m.local_steps, "steps", 10**9), "steps must be in"),
        (lambda m: m.local_steps.learning_rates.append(1e-3), "3 learning rates for 2 steps"),
        (lambda m: m.local_steps.learning_rates.__setitem__(0, float("nan")), "learning_rates must be finite"),
        (lambda m: m.local_steps.learning_rates.__setitem__(1, -1.0), "learning_rates must be finite"),
        (lambda m: m.local_steps.learning_rates.__setitem__(1, 1e300), "learning_rates must be finite"),
        (lambda m: setattr(m.local_steps, "clip_grad_norm", float("inf")), "clip_grad_norm"),
        (lambda m: setattr(m.local_steps.optimizer, "name", "lion"), "inner optimizer"),
        (lambda m: setattr(m.local_steps.optimizer, "beta1", 1.5), "inner optimizer"),
        (lambda m: setattr(m.local_steps.optimizer, "weight_decay", float("nan")), "inner optimizer"),
        (lambda m: m.local_steps.ClearField("optimizer"), "optimizer missing"),
        (lambda m: m.local_steps.optimizer.lr_scales.add(name="w", factor=0.0), "w's factor must be in"),
        (lambda m: m.local_steps.optimizer.lr_scales.add(name="w", factor=float("nan")), "w's factor must be in"),
        (lambda m: m.local_steps.optimizer.lr_scales.add(name="", factor=2.0), "a name of 1-512"),
        (lambda m: m.local_steps.optimizer.lr_scales.add(name="w" * 513, factor=2.0), "a name of 1-512"),
        (lambda m: [m.local_steps.optimizer.lr_scales.add(name="w", factor=2.0) for _ in range(2)], "twice"),
        (
            lambda m: [m.local_steps.optimizer.lr_scales.add(name=f"p{i}", factor=2.0) for i in range(65)],
            "more than 64 lr_scales",
        ),
        (
            lambda m: (setattr(m.local_steps, "steps", 3), m.local_steps.learning_rates.append(1e-3)),
            "does not split into 3",
        ),
    ],
)
def test_local_steps_from_proto_rejects(mangle, message: str) -> None:
    msg = protocol.order_to_proto(order(local_steps=local(2)))
    mangle(msg)
    with pytest.raises(ProtocolError, match=message):
        protocol.order_from_proto(msg)


def test_order_from_proto_rejects_a_foreign_payload_version(gradient: CompressedGradient) -> None:
    msg = protocol.order_to_proto(order(update=StateUpdate(0.1, (gradient,), (1.0,))))
    msg.update.replay.payloads[0].format_version = 99
    with pytest.raises(PayloadError, match="format version"):
        protocol.order_from_proto(msg)


def test_round_result_round_trip(gradient: CompressedGradient) -> None:
    timings = {"update": 0.5, "compute": 1.0, "compress": 0.25, "total": 1.75}
    ok = RoundResult(protocol.OK, 4, "", gradient, 9.0, 32, 2, timings)
    assert (
        protocol.result_from_proto(protocol.parse(pb.RoundResult, protocol.result_to_proto(ok).SerializeToString()))
        == ok
    )
    needs = protocol.result_from_proto(protocol.result_to_proto(RoundResult(protocol.NEEDS_STATE, 4, "no replica")))
    assert (needs.status, needs.reason, needs.gradient) == (protocol.NEEDS_STATE, "no replica", None)


def test_round_result_rejects_unknown_status_and_ok_without_gradient() -> None:
    with pytest.raises(ProtocolError, match="unknown round status"):
        protocol.result_from_proto(pb.RoundResult(status=pb.RoundResult.STATUS_UNSPECIFIED))
    with pytest.raises(ProtocolError, match="must carry a gradient"):
        protocol.result_from_proto(pb.RoundResult(status=pb.RoundResult.STATUS_OK))


def test_worker_state_round_trip() -> None:
    ws = WorkerState("run", 3, {"w": torch.randn(4, 4)}, {"w/exp_avg": torch.randn(4, 4), "w/step": torch.tensor(3.0)})
    back = protocol.worker_state_from_proto(protocol.worker_state_to_proto(ws))
    assert (back.run_id, back.version, list(back.feedback), list(back.inner_optimizer)) == (
        "run",
        3,
        ["w"],
        ["w/exp_avg", "w/step"],
    )
    assert torch.equal(back.feedback["w"], ws.feedback["w"])
    assert all(torch.equal(back.inner_optimizer[k], v) for k, v in ws.inner_optimizer.items())


def test_eager_starts_and_streamed_gradients_are_refused_where_they_mean_nothing() -> None:
    optimizer = InnerOptimizerConfig()
    with pytest.raises(ProtocolError, match="eager_lr must be finite"):
        protocol.LocalSteps(1, optimizer, (0.1,), eager_lr=-1.0)
    with pytest.raises(ProtocolError, match="no eager start"):
        protocol.LocalSteps(2, optimizer, (0.1, 0.1), fragment=Fragment(0, 2), eager_lr=1.0)
    eager = protocol.LocalSteps(1, optimizer, (0.1,), eager_lr=0.5)
    assert protocol.local_steps_from_proto(protocol.local_steps_to_proto(eager)) == eager
    order = protocol.WorkOrder(
        "run", 1, 1, np.zeros((1, 9), np.uint16), CodecConfig(), Fingerprint((), (), ()), local_steps=eager
    )
    with pytest.raises(ProtocolError, match="only with compute_before_update"):
        protocol.order_from_proto(protocol.order_to_proto(order))
    overlapped = dataclasses.replace(order, compute_before_update=True)
    assert protocol.order_from_proto(protocol.order_to_proto(overlapped)).local_steps == eager
    with pytest.raises(ProtocolError, match="stream_buckets must be 0"):
        protocol.order_from_proto(protocol.order_to_proto(dataclasses.replace(overlapped, stream_buckets=2)))
    gradient = dataclasses.replace(order, local_steps=None, stream_buckets=65)
    with pytest.raises(ProtocolError, match="stream_buckets is at most 64"):
        protocol.order_from_proto(protocol.order_to_proto(gradient))
    with pytest.raises(ProtocolError, match="where the round's result was expected"):
        protocol.result_from_proto(pb.RoundResult(round=1, piece=True))
