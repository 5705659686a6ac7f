"""A model state that travels a tensor at a time: neither end ever holds it whole as bytes.

A ``ModelState`` (proto/gradwire/v1/worker.proto) is the largest message of the protocol: a model's
parameters and then some. ``state_parts`` writes it as ``Part``s the way ``protocol.to_parts`` frames any
message, but field by field: the small fields first (protobuf lets fields come in any order), then one
tensor field at a time, each serialized only when its turn comes. Its byte count, which every part
declares, is worked out beforehand from the tensors' shapes.

``read_state`` takes the parts as they arrive and yields *pieces*: the header (every field but the
tensors) first, then each tensor field as soon as its last byte is in. Each piece is itself a serialized
``ModelState`` (the header alone, or one tensor), so a node's rank 0 can hand a piece to its other ranks as
the bytes it received, and every rank decodes it alike (``decode_header``, ``decode_tensor``). A receiver
holds at most one tensor and one part at a time.

The framing's checks hold as for any message: the declared size against the receiver's limit on the first
part, the hash on the last. Pieces come out before the hash is checked, so whoever consumes them commits
nothing until the iterator has ended without an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from gradwire import protocol
from gradwire.compression import CompressedGradient
from gradwire.protocol import PART_BYTES, ModelState, ProtocolError
from gradwire.v1 import worker_pb2 as pb

# The repeated Tensor fields of ModelState, by field number, as ModelState's dataclass names them.
TENSOR_FIELDS = {
    pb.ModelState.PARAMETERS_FIELD_NUMBER: "parameters",
    pb.ModelState.OPTIMIZER_STATE_FIELD_NUMBER: "optimizer_state",
    pb.ModelState.FEEDBACK_FIELD_NUMBER: "feedback",
    pb.ModelState.INNER_OPTIMIZER_FIELD_NUMBER: "inner_optimizer",
    pb.ModelState.GOSSIP_MODEL_FIELD_NUMBER: "gossip_model",
}
_LENGTH_DELIMITED = 2


@dataclasses.dataclass(frozen=True)
class StateHeader:
    """Everything of a ModelState but its tensors: enough to size and build the model before they come."""

    run_id: str
    version: int
    model_json: str
    update_rule_json: str
    protocol_version: int = protocol.PROTOCOL_VERSION
    own: tuple[int, CompressedGradient] | None = None  # ModelState.own
    gossip: bool = False  # ModelState.gossip

    @classmethod
    def of(cls, state: ModelState) -> StateHeader:
        return cls(
            state.run_id,
            state.version,
            state.model_json,
            state.update_rule_json,
            state.protocol_version,
            state.own,
            state.gossip,
        )


# ------------------------------------------------------------------------------------------- sending


def state_parts(state: ModelState, part_bytes: int = PART_BYTES) -> Iterator[pb.Part]:
    """``state`` framed as parts, serialized one tensor at a time (see the module's docstring)."""
    tensors = [(field, name, t) for field, kind in TENSOR_FIELDS.items() for name, t in getattr(state, kind).items()]
    bare = dataclasses.replace(
        state, parameters={}, optimizer_state={}, feedback={}, inner_optimizer={}, gossip_model={}
    )
    header = protocol.state_to_proto(bare).SerializeToString()
    total = len(header) + sum(_tensor_field_bytes(name, t) for _, name, t in tensors)  # checks every dtype too

    def pieces() -> Iterator[bytes]:
        yield header
        for field, name, t in tensors:
            yield tensor_piece(field, name, t)

    return protocol.frame(pieces(), part_bytes, total)


def tensor_piece(field: int, name: str, t: torch.Tensor) -> bytes:
    """One tensor as a serialized ModelState holding only it, in the field ``field``."""
    msg = pb.ModelState()
    getattr(msg, TENSOR_FIELDS[field]).append(protocol.tensor_to_proto(name, t))
    return msg.SerializeToString()


def serialize(m: pb.ModelState) -> bytes:
    """A ModelState message's bytes in a streamed state's order (its other fields, then its tensors), all at
    once: for a message that is small anyway (a test's, a fuzzer's)."""
    header = pb.ModelState()
    header.CopyFrom(m)
    pieces = []
    for kind in TENSOR_FIELDS.values():
        header.ClearField(kind)
        for t in getattr(m, kind):
            piece = pb.ModelState()
            getattr(piece, kind).append(t)
            pieces.append(piece.SerializeToString())
    return header.SerializeToString() + b"".join(pieces)


def _tensor_field_bytes(name: str, t: torch.Tensor) -> int:
    """The bytes ``tensor_piece`` will take, from the tensor's name, shape and dtype alone."""
    code, np_dtype = protocol.dtype_code(name, t.dtype)
    data = t.numel() * np_dtype.itemsize
    message = pb.Tensor(name=name, shape=list(t.shape), dtype=code).ByteSize()
    message += 1 + _varint_bytes(data) + data if data else 0  # field 4's tag (one byte), length, bytes
    return 1 + _varint_bytes(message) + message  # a ModelState tensor field's tag (one byte), length, message


def _varint_bytes(n: int) -> int:
    return max(1, -(-n.bit_length() // 7))


# ------------------------------------------------------------------------------------------- receiving


def read_state(parts: Iterable[pb.Part], max_bytes: int, limit_reason: str = "--max-message-mb") -> Iterator[bytes]:
    """The pieces of a framed ModelState as they complete: the header first (``decode_header``), then one
    piece per tensor (``decode_tensor``). ``ProtocolError`` for a broken frame (``protocol.Unframer``), a
    malformed field, or a header field that follows a tensor."""
    unframe = protocol.Unframer(max_bytes, limit_reason)
    buf, header = bytearray(), bytearray()
    header_done = False
    for part in parts:
        buf += unframe.take(part)
        start = 0
        while (field := _next_field(buf, start)) is not None:
            number, end = field
            if number in TENSOR_FIELDS:
                if not header_done:
                    header_done = True
                    yield bytes(header)
                yield bytes(buf[start:end])
            elif header_done:
                raise ProtocolError(
                    f"model state: field {number} follows its tensors (a streamed state sends its other fields first)"
                )
            else:
                header += buf[start:end]
            start = end
        del buf[:start]
        if unframe.done:
            if buf:
                raise ProtocolError(f"model state: its last field is cut short ({len(buf)} bytes left over)")
            if not header_done:
                yield bytes(header)
            return
    unframe.check_complete()


def _next_field(buf: bytearray, start: int) -> tuple[int, int] | None:
    """(field number, end offset) of the protobuf field at ``start``; ``None`` if it is not all in yet."""
    tag = _varint(buf, start)
    if tag is None:
        return None
    key, pos = tag
    number, wire = key >> 3, key & 7
    if number == 0:
        raise ProtocolError("model state: field number 0")
    if wire == 0:
        value = _varint(buf, pos)
        return None if value is None else (number, value[1])
    if wire == 1 or wire == 5:
        end = pos + (8 if wire == 1 else 4)
        return (number, end) if end <= len(buf) else None
    if wire == _LENGTH_DELIMITED:
        length = _varint(buf, pos)
        if length is None:
            return None
        end = length[1] + length[0]
        return (number, end) if end <= len(buf) else None
    raise ProtocolError(f"model state: field {number} has wire type {wire}, which no field of it uses")


def _varint(buf: bytearray, pos: int) -> tuple[int, int] | None:
    """(value, offset after it) of the varint at ``pos``; ``None`` if it is not all in yet."""
    value = 0
    for i in range(10):
        if pos + i >= len(buf):
            return None
        byte = buf[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, pos + i + 1
    raise ProtocolError("model state: a varint runs past 10 bytes")


def decode_header(piece: bytes) -> StateHeader:
    """The header piece, checked: protocol version and run id."""
    m = protocol.parse(pb.ModelState, piece)
    protocol.check_version(m.protocol_version)
    protocol.check_run_id(m.run_id, "model state")
    for field in ("model_json", "update_rule_json"):
        if not getattr(m, field):
            raise ProtocolError(
                f"model state has no {field} before its tensors (a streamed state sends its other fields first)"
            )
    own = protocol.own_from_proto(m)
    return StateHeader(m.run_id, m.version, m.model_json, m.update_rule_json, m.protocol_version, own, m.gossip)


def decode_tensor(piece: bytes) -> tuple[str, str, torch.Tensor]:
    """A tensor piece: (its field's name in ModelState, e.g. "parameters"; the tensor's name; the tensor),
    checked as ``protocol.tensors_from_proto`` checks tensors (a known dtype, its bytes, finite values)."""
    m = protocol.parse(pb.ModelState, piece)
    found = [(kind, t) for kind in TENSOR_FIELDS.values() for t in getattr(m, kind)]
    if len(found) != 1:
        raise ProtocolError(f"a model state's tensor piece holds {len(found)} tensors, not one")
    kind, msg = found[0]
    ((name, tensor),) = protocol.tensors_from_proto([msg], kind).items()
    return kind, name, tensor
