"""The compressed gradient as plain data: what crosses the wire, before and after protobuf.

These dataclasses mirror ``proto/gradwire/v1/codec.proto`` field for field; ``serde`` converts between
the two. Everything here is bytes and numbers: no tensors, no pickles.

Byte layouts (all little-endian):
  indices  12-bit chunk-local indices, two per 3 bytes: ``a | b << 12``; an odd count ends with a zero pad.
           Ordered chunk by chunk (row-major chunk grid), ``k`` per chunk.
  values   in the same order as the indices; ``n`` values per tensor.
           ``LUT``: one bin id per value in ``bits = ceil(log2(bins))`` bits (bins=4: 2 bits, four values a
           byte; bins=256: one byte each), packed as an LSB-first bit stream: bit j of code i is stream
           bit ``i * bits + j``, in byte ``(i * bits + j) // 8`` at position ``(i * bits + j) % 8``;
           ``ceil(n * bits / 8)`` bytes, the last byte's unused high bits zero; every code < bins. The
           value is ``shift + scale * lut[bin]``, where ``lut`` holds ``bins`` float16 entries: each
           bin's mean in bin units, so the table stays exact to ~1/16 of a bin whatever the gradient's
           magnitude.
           ``SIGN``: one bit per value in the same bit stream (``bits = 1``, ``ceil(n / 8)`` bytes), set
           for a negative value; the value is ``-scale`` or ``+scale``, ``scale`` being the mean
           magnitude of the tensor's kept values (finite, >= 0). ``shift`` is 0, ``lut`` empty.
           ``FLOAT32``: four bytes per value.
           ``INT8`` (``LOW_RANK`` only): the factors' int8 codes, A's (rows x k) then B's (k x cols), row-major;
           ``lut`` holds 2k float32 scales, A's columns' then B's rows'; see ``lowrank``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

from gradwire.compression.config import FORMAT_VERSION, CodecConfig


class Encoding(enum.IntEnum):
    """How a tensor's elements are selected. Values match the proto enum."""

    SPARSE = 1  # chunked (DCT) coefficients, top-k per chunk, 12-bit packed indices
    DENSE = 2  # every element, in row-major order, no indices
    LOW_RANK = 3  # the matrix view as k rank-one terms A @ B (``lowrank``), int8 codes and float32 scales


class ValueFormat(enum.IntEnum):
    """How the selected values are stored. Values match the proto enum."""

    FLOAT32 = 1  # raw, four bytes per value
    LUT = 2  # ceil(log2(bins))-bit bin ids, decoded through a per-tensor table
    SIGN = 3  # one sign bit per value, +-scale
    INT8 = 4  # LOW_RANK factors: one signed byte per entry, a float32 scale per factor in ``lut``
    INT4 = 5  # LOW_RANK factors: two codes in [-7, 7] a byte (``lowrank.pack_int4``), scales as INT8's


# The tensor name a PayloadError carries when the problem is about the payload as a whole.
GRADIENT = "<gradient>"


class PayloadError(ValueError):
    """A payload that does not match what the receiver expects. Names the tensor and field."""

    def __init__(self, tensor: str, field: str, reason: str) -> None:
        super().__init__(f"bad payload: tensor {tensor!r}, field {field!r}: {reason}")
        self.tensor = tensor
        self.field = field
        self.reason = reason


class NonFiniteInput(ArithmeticError):
    """``compress`` was given a NaN, an infinity or a value past ``codec.VALUE_LIMIT``: the sender's training
    diverged. Names the tensor."""

    def __init__(self, tensor: str) -> None:
        super().__init__(
            f"the gradient of {tensor!r} is not finite (or past 1e30): training diverged (try a lower learning "
            "rate, or --clip-grad-norm)"
        )
        self.tensor = tensor


@dataclasses.dataclass(frozen=True)
class CompressedTensor:
    name: str
    shape: tuple[int, ...]
    encoding: Encoding
    value_format: ValueFormat
    chunk_shape: tuple[int, ...]  # () for DENSE and LOW_RANK
    k: int  # kept per chunk; 0 for DENSE; the rank for LOW_RANK
    indices: bytes  # b"" for DENSE
    values: bytes
    shift: float = 0.0  # LUT only (0 for SIGN)
    scale: float = 0.0  # LUT: bin width; SIGN: mean magnitude
    lut: bytes = b""  # LUT: the bin table; INT8: the factors' scales

    @property
    def nbytes(self) -> int:
        return len(self.indices) + len(self.values) + len(self.lut)


@dataclasses.dataclass(frozen=True)
class CompressedGradient:
    settings: CodecConfig
    tensors: tuple[CompressedTensor, ...]
    format_version: int = FORMAT_VERSION

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of tensor data (indices, values, lookup tables); protobuf framing adds a little. Counted once
        (a round's records and decisions ask several times; opt-125m has 196 tensors)."""
        return sum(t.nbytes for t in self.tensors)
