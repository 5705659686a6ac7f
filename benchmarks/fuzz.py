"""A fuzzer for the Worker service, built from the proto: mutated valid messages of every RPC, and garbage.

Each call starts from a valid message (a state push, a work order with a replay update, a Describe, a
FetchWorkerState) and mutates it through protobuf reflection: a scalar field anywhere in the message tree
set to an extreme of its type (NaN, inf, 1e308, 2**64 - 1, "", "null", 64 KiB of text, random bytes), a
repeated field emptied or doubled, a sub-message cleared; or the serialized bytes flipped, truncated or
extended; or a raw stream of parts with lying sizes. Framing is kept valid for most mutations, so they
reach the parser and the validators behind it rather than dying at the hash check.

``fuzz`` sends ``calls`` of them, each with a short deadline, and counts the answers by RPC and status
code; ``benchmarks.hostile`` runs it against a ``worker serve`` process and
``tests/integration/test_fuzz.py`` against one in a test.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Iterator, Sequence

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from gradwire import protocol, statestream
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc

_FLOATS = (float("nan"), float("inf"), -float("inf"), 1e308, -1e308, -1.0, 0.0, 1e-45, 3.5e38)
_INTS = (0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1)
_SINTS = (-1, -(2**31), -(2**63))
_STRINGS = (
    "",
    "null",
    "[]",
    "{}",
    '{"arch": "gpt", "config": {"n_layer": 1000000000}}',
    "x" * 65536,
    "\x00",
    "é" * 100,
)
_UNSIGNED = (
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_FIXED64,
)


def _fields(msg: Message) -> Iterator[tuple[Message, FieldDescriptor]]:
    """Every (message, field) in the tree under ``msg``, set or not (sub-messages of set fields only)."""
    for field in msg.DESCRIPTOR.fields:
        yield msg, field
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type.GetOptions().map_entry:
            continue
        if field.is_repeated:
            for child in getattr(msg, field.name)[:4]:
                yield from _fields(child)
        elif msg.HasField(field.name):
            yield from _fields(getattr(msg, field.name))


def _extreme(field: FieldDescriptor, rng: random.Random) -> object:
    t = field.type
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice(_FLOATS)
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.TYPE_STRING:
        return rng.choice(_STRINGS)
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 7, 64, 4096)))
    if t == FieldDescriptor.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    limit = 2**32 - 1 if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32) else 2**64 - 1
    if t in _UNSIGNED:
        return min(rng.choice(_INTS), limit)
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return rng.choice((0, 1, 2**31 - 1, -1, -(2**31)))
    return rng.choice(_INTS[:3] + _SINTS)


def mutate(msg: Message, rng: random.Random) -> Message:
    """A copy of ``msg`` with one to three fields somewhere in it set, cleared or repeated oddly."""
    out = type(msg)()
    out.CopyFrom(msg)
    for _ in range(rng.randint(1, 3)):
        holder, field = rng.choice(list(_fields(out)))
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated and not field.message_type.GetOptions().map_entry:
                items = getattr(holder, field.name)
                if len(items) and rng.random() < 0.5:
                    items.add().CopyFrom(items[0])  # a duplicate (a tensor twice, a payload more)
                else:
                    del items[:]
            else:
                holder.ClearField(field.name)
            continue
        value = _extreme(field, rng)
        try:
            if field.is_repeated:
                items = getattr(holder, field.name)
                if len(items):
                    items[rng.randrange(len(items))] = value
                else:
                    items.append(value)
            else:
                setattr(holder, field.name, value)
        except (ValueError, TypeError):  # a value this field's type cannot hold (e.g. bad UTF-8)
            continue
    return out


def _bytes_mutation(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(3)
    if kind == 0 and b:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 1:
        return bytes(b[: rng.randrange(len(b) + 1)])
    return bytes(b) + rng.randbytes(rng.randint(1, 64))


def _parts(data: bytes, rng: random.Random) -> list[pb.Part]:
    """``data`` framed, mostly correctly; sometimes with a lying size, a missing end or a bad hash."""
    parts = list(protocol.to_parts(_Raw(data), part_bytes=rng.choice((64 << 10, 2 << 20))))
    kind = rng.randrange(10)
    if kind == 0:
        return [pb.Part(data=data[:1024], total_bytes=rng.choice((1 << 40, 2**64 - 1)))]
    if kind == 1:
        return parts[:-1]
    if kind == 2:
        parts[-1].sha256 = bytes(32)
    if kind == 3:
        parts[0].total_bytes = max(0, len(data) - 1)
    return parts


class _Raw:
    """Quacks like a message for ``protocol.to_parts``: bytes that serialize to themselves."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


RPCS = ("Describe", "PushState", "RunRound", "FetchWorkerState", "garbage")


def fuzz(
    channel: grpc.Channel,
    state: pb.ModelState,
    order: pb.WorkOrder,
    *,
    calls: int,
    seconds: float,
    seed: int = 0,
    metadata: Sequence[tuple[str, str]] = (),
    deadline: float = 5.0,
) -> dict[str, dict[str, int]]:
    """Send up to ``calls`` fuzzed calls (stopping after ``seconds``); answers by RPC and status code."""
    rng = random.Random(seed)
    stub = worker_pb2_grpc.WorkerStub(channel)
    raw = channel.unary_unary(
        "/gradwire.v1.Worker/Describe", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    raw_stream = channel.stream_stream(
        "/gradwire.v1.Worker/RunRound", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    counts: dict[str, collections.Counter[str]] = {rpc: collections.Counter() for rpc in RPCS}
    md = list(metadata)
    stop = time.monotonic() + seconds
    for _ in range(calls):
        if time.monotonic() > stop:
            break
        rpc = rng.choice(RPCS)
        try:
            if rpc == "Describe":
                stub.Describe(
                    mutate(pb.DescribeRequest(protocol_version=protocol.PROTOCOL_VERSION), rng),
                    timeout=deadline,
                    metadata=md,
                )
            elif rpc == "FetchWorkerState":
                list(
                    stub.FetchWorkerState(
                        mutate(pb.FetchWorkerStateRequest(run_id=state.run_id), rng), timeout=deadline, metadata=md
                    )
                )
            elif rpc == "PushState":
                stub.PushState(iter(_parts(_payload(state, rng), rng)), timeout=deadline, metadata=md)
            elif rpc == "RunRound":
                list(stub.RunRound(iter(_parts(_payload(order, rng), rng)), timeout=deadline, metadata=md))
            elif rng.random() < 0.5:
                raw(rng.randbytes(rng.randint(0, 256)), timeout=deadline, metadata=md)
            else:
                list(
                    raw_stream(
                        iter([rng.randbytes(rng.randint(0, 256)) for _ in range(rng.randint(0, 3))]),
                        timeout=deadline,
                        metadata=md,
                    )
                )
            counts[rpc]["OK"] += 1
        except grpc.RpcError as e:
            counts[rpc][e.code().name] += 1
    return {rpc: dict(c) for rpc, c in counts.items()}


def _payload(msg: Message, rng: random.Random) -> bytes:
    if rng.random() < 0.8:
        return _serialized(mutate(msg, rng))
    return _bytes_mutation(_serialized(msg), rng)


def _serialized(msg: Message) -> bytes:
    """A state in the order a worker streams it (``gradwire.statestream``), so that mutations reach its checks."""
    return statestream.serialize(msg) if isinstance(msg, pb.ModelState) else msg.SerializeToString()
