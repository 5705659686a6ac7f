"""The worker protocol as plain data, and its one serde boundary with ``gradwire.v1.worker_pb2``.

Coordinator and worker speak in these dataclasses; only this module (and ``compression.serde`` for the
codec's messages) touches protobuf types. Large messages travel framed: ``to_parts`` serializes a message
and cuts it into ``Part`` messages; ``join_parts`` checks the total size and SHA-256 before anything is
parsed. Everything from the network is checked; problems raise ``ProtocolError`` (or the codec's
``PayloadError``), both ``ValueError``s, which servers answer with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from gradwire.compression import CodecConfig, CompressedGradient, PayloadError
from gradwire.compression import serde as codec_serde
from gradwire.replica import Fingerprint, StateUpdate
from gradwire.v1 import worker_pb2 as pb

# Bump when a message's meaning changes; both sides refuse to talk across versions.
PROTOCOL_VERSION = 1
PART_BYTES = 2 << 20  # well under gRPC's default 4 MB message limit


class ProtocolError(ValueError):
    """A message that is malformed or not what this side expects."""


# ------------------------------------------------------------------------------------------- framing


def to_parts(message: Message, part_bytes: int = PART_BYTES) -> Iterator[pb.Part]:
    data = message.SerializeToString()
    digest = hashlib.sha256(data).digest()
    view = memoryview(data)
    starts = range(0, max(len(data), 1), part_bytes)
    for i, start in enumerate(starts):
        last = i == len(starts) - 1
        chunk = bytes(view[start : start + part_bytes])
        yield pb.Part(data=chunk, last=last, total_bytes=len(data) if last else 0, sha256=digest if last else b"")


def join_parts(parts: Iterable[pb.Part], max_bytes: int) -> bytes:
    """Concatenate a framed message; check size, completeness and hash."""
    buf = bytearray()
    for part in parts:
        buf += part.data
        if len(buf) > max_bytes:
            raise ProtocolError(f"message exceeds the {max_bytes >> 20} MB limit (--max-message-mb)")
        if part.last:
            if part.total_bytes != len(buf):
                raise ProtocolError(f"framed message is {len(buf)} bytes, its last part says {part.total_bytes}")
            if hashlib.sha256(buf).digest() != part.sha256:
                raise ProtocolError("framed message failed its SHA-256 check")
            return bytes(buf)
    raise ProtocolError("framed message ended before its last part")


def parse(cls: type[Message], data: bytes) -> Message:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise ProtocolError(f"not a {cls.__name__} message: {e}") from None
    return msg


# ------------------------------------------------------------------------------------------- tensors

_DTYPES: dict[torch.dtype, tuple[int, np.dtype]] = {
    torch.float32: (pb.DTYPE_FLOAT32, np.dtype("<f4")),
    torch.bfloat16: (pb.DTYPE_BFLOAT16, np.dtype("<i2")),  # numpy has no bf16: travel as raw 16-bit words
    torch.float16: (pb.DTYPE_FLOAT16, np.dtype("<f2")),
    torch.int32: (pb.DTYPE_INT32, np.dtype("<i4")),
    torch.int64: (pb.DTYPE_INT64, np.dtype("<i8")),
    torch.uint8: (pb.DTYPE_UINT8, np.dtype("u1")),
}
_BY_CODE = {code: (dtype, np_dtype) for dtype, (code, np_dtype) in _DTYPES.items()}


def tensor_to_proto(name: str, t: torch.Tensor) -> pb.Tensor:
    if t.dtype not in _DTYPES:
        raise ProtocolError(f"tensor {name!r}: dtype {t.dtype} cannot travel")
    code, np_dtype = _DTYPES[t.dtype]
    host = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    return pb.Tensor(name=name, shape=list(t.shape), dtype=code, data=host.numpy().astype(np_dtype, copy=False).tobytes())


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    if msg.dtype not in _BY_CODE:
        raise ProtocolError(f"tensor {msg.name!r}: unknown dtype {msg.dtype}")
    dtype, np_dtype = _BY_CODE[msg.dtype]
    shape = tuple(msg.shape)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(msg.data) != numel * np_dtype.itemsize:
        raise ProtocolError(f"tensor {msg.name!r}: {len(msg.data)} bytes for shape {shape} of {dtype}")
    t = torch.from_numpy(np.frombuffer(msg.data, np_dtype).copy()).reshape(shape)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def tensors_to_proto(tensors: Mapping[str, torch.Tensor]) -> list[pb.Tensor]:
    return [tensor_to_proto(n, t) for n, t in tensors.items()]


def tensors_from_proto(msgs: Iterable[pb.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for m in msgs:
        if m.name in out:
            raise ProtocolError(f"tensor {m.name!r} appears twice")
        out[m.name] = tensor_from_proto(m)
    return out


# ------------------------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    protocol_version: int
    gradwire_version: str
    torch_version: str
    device: str
    device_name: str = ""
    local_devices: int = 1
    replicas: Mapping[str, int] = dataclasses.field(default_factory=dict)


def info_to_proto(info: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(**{**dataclasses.asdict(info), "replicas": dict(info.replicas)})


def info_from_proto(msg: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(msg.protocol_version, msg.gradwire_version, msg.torch_version, msg.device, msg.device_name, msg.local_devices, dict(msg.replicas))


@dataclasses.dataclass
class ModelState:
    run_id: str
    version: int
    model_json: str
    parameters: dict[str, torch.Tensor]
    update_rule_json: str
    optimizer_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    feedback: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    protocol_version: int = PROTOCOL_VERSION


def state_to_proto(s: ModelState) -> pb.ModelState:
    return pb.ModelState(
        protocol_version=s.protocol_version, run_id=s.run_id, version=s.version, model_json=s.model_json,
        parameters=tensors_to_proto(s.parameters), update_rule_json=s.update_rule_json,
        optimizer_state=tensors_to_proto(s.optimizer_state), feedback=tensors_to_proto(s.feedback),
    )


def state_from_proto(m: pb.ModelState) -> ModelState:
    _check_version(m.protocol_version)
    if not m.run_id:
        raise ProtocolError("model state has no run_id")
    return ModelState(
        m.run_id, m.version, m.model_json, tensors_from_proto(m.parameters), m.update_rule_json,
        tensors_from_proto(m.optimizer_state), tensors_from_proto(m.feedback), m.protocol_version,
    )


def fingerprint_to_proto(f: Fingerprint) -> pb.Fingerprint:
    return pb.Fingerprint(sums=f.sums, sumsqs=f.sumsqs, samples=f.samples)


def fingerprint_from_proto(m: pb.Fingerprint) -> Fingerprint:
    return Fingerprint(tuple(m.sums), tuple(m.sumsqs), tuple(m.samples))


def update_to_proto(u: StateUpdate) -> pb.StateUpdate:
    if u.delta is not None:
        return pb.StateUpdate(delta=codec_serde.gradient_to_proto(u.delta), learning_rate=u.learning_rate)
    # No weights means equal weights (as in Replica.apply); the wire always carries one per payload.
    weights = u.weights or [1.0] * len(u.payloads)
    replay = pb.Replay(payloads=[codec_serde.gradient_to_proto(p) for p in u.payloads], weights=weights)
    return pb.StateUpdate(replay=replay, learning_rate=u.learning_rate)


def update_from_proto(m: pb.StateUpdate) -> StateUpdate:
    kind = m.WhichOneof("kind")
    if kind == "delta":
        return StateUpdate(m.learning_rate, delta=codec_serde.gradient_from_proto(m.delta))
    if kind == "replay":
        if len(m.replay.weights) != len(m.replay.payloads) or not m.replay.payloads:
            raise ProtocolError(f"replay has {len(m.replay.payloads)} payloads and {len(m.replay.weights)} weights")
        payloads = tuple(codec_serde.gradient_from_proto(p) for p in m.replay.payloads)
        return StateUpdate(m.learning_rate, payloads, tuple(m.replay.weights))
    raise ProtocolError("state update carries neither a replay nor a delta")


_BATCH_DTYPES = {pb.DTYPE_UINT16: np.dtype("<u2"), pb.DTYPE_INT32: np.dtype("<i4")}


@dataclasses.dataclass
class WorkOrder:
    run_id: str
    round: int
    base_version: int
    batch: np.ndarray  # (rows, sequence_length + 1) token ids, uint16 or int32
    codec: CodecConfig
    fingerprint: Fingerprint
    update: StateUpdate | None = None
    feedback_beta: float = 0.999
    micro_batch_size: int = 0
    sync_tolerance: float = 1e-4
    protocol_version: int = PROTOCOL_VERSION


def order_to_proto(o: WorkOrder) -> pb.WorkOrder:
    code = {v: k for k, v in _BATCH_DTYPES.items()}.get(o.batch.dtype.newbyteorder("<"))
    if code is None or o.batch.ndim != 2:
        raise ProtocolError(f"token batch must be a 2-D uint16 or int32 array, got {o.batch.dtype} {o.batch.shape}")
    batch = pb.TokenBatch(rows=o.batch.shape[0], columns=o.batch.shape[1], dtype=code, data=np.ascontiguousarray(o.batch).astype(_BATCH_DTYPES[code]).tobytes())
    return pb.WorkOrder(
        protocol_version=o.protocol_version, run_id=o.run_id, round=o.round, base_version=o.base_version,
        update=update_to_proto(o.update) if o.update is not None else None,
        fingerprint=fingerprint_to_proto(o.fingerprint), batch=batch,
        codec=codec_serde.settings_to_proto(o.codec), feedback_beta=o.feedback_beta, micro_batch_size=o.micro_batch_size,
        sync_tolerance=o.sync_tolerance,
    )


def order_from_proto(m: pb.WorkOrder) -> WorkOrder:
    _check_version(m.protocol_version)
    if not m.run_id:
        raise ProtocolError("work order has no run_id")
    b = m.batch
    if b.dtype not in _BATCH_DTYPES:
        raise ProtocolError(f"token batch dtype {b.dtype} is not uint16 or int32")
    np_dtype = _BATCH_DTYPES[b.dtype]
    if b.rows == 0 or b.columns < 2 or len(b.data) != b.rows * b.columns * np_dtype.itemsize:
        raise ProtocolError(f"token batch of {b.rows}x{b.columns} does not match its {len(b.data)} bytes")
    batch = np.frombuffer(b.data, np_dtype).reshape(b.rows, b.columns)
    if not 0.0 <= m.feedback_beta <= 1.0:
        raise ProtocolError(f"feedback_beta must be in [0, 1], got {m.feedback_beta}")
    if not 0.0 <= m.sync_tolerance < 1.0:
        raise ProtocolError(f"sync_tolerance must be in [0, 1), got {m.sync_tolerance}")
    try:
        codec = codec_serde.settings_from_proto(m.codec)
    except PayloadError as e:
        raise ProtocolError(f"work order codec settings: {e.reason}") from None
    return WorkOrder(
        m.run_id, m.round, m.base_version, batch, codec, fingerprint_from_proto(m.fingerprint),
        update_from_proto(m.update) if m.HasField("update") else None,
        m.feedback_beta, m.micro_batch_size, m.sync_tolerance, m.protocol_version,
    )


OK = "ok"
NEEDS_STATE = "needs_state"
_STATUS = {OK: pb.RoundResult.STATUS_OK, NEEDS_STATE: pb.RoundResult.STATUS_NEEDS_STATE}


@dataclasses.dataclass
class RoundResult:
    status: str
    round: int
    reason: str = ""
    gradient: CompressedGradient | None = None
    loss: float = float("nan")
    tokens: int = 0
    version: int = 0
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)


def result_to_proto(r: RoundResult) -> pb.RoundResult:
    return pb.RoundResult(
        status=_STATUS[r.status], reason=r.reason, round=r.round,
        gradient=codec_serde.gradient_to_proto(r.gradient) if r.gradient is not None else None,
        loss=r.loss, tokens=r.tokens, version=r.version,
        timings=pb.Timings(**{f"{k}_seconds": v for k, v in r.timings.items()}),
    )


def result_from_proto(m: pb.RoundResult) -> RoundResult:
    status = {v: k for k, v in _STATUS.items()}.get(m.status)
    if status is None:
        raise ProtocolError(f"unknown round status {m.status}")
    if status == OK and not m.HasField("gradient"):
        raise ProtocolError("an OK round result must carry a gradient")
    timings = {f.name.removesuffix("_seconds"): v for f, v in m.timings.ListFields()}
    gradient = codec_serde.gradient_from_proto(m.gradient) if m.HasField("gradient") else None
    return RoundResult(status, m.round, m.reason, gradient, m.loss, m.tokens, m.version, timings)


@dataclasses.dataclass
class FeedbackState:
    run_id: str
    version: int
    buffers: dict[str, torch.Tensor]


def feedback_to_proto(f: FeedbackState) -> pb.FeedbackState:
    return pb.FeedbackState(run_id=f.run_id, version=f.version, buffers=tensors_to_proto(f.buffers))


def feedback_from_proto(m: pb.FeedbackState) -> FeedbackState:
    return FeedbackState(m.run_id, m.version, tensors_from_proto(m.buffers))


def _check_version(v: int) -> None:
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v} is not this side's {PROTOCOL_VERSION}: upgrade the older of coordinator and worker")
