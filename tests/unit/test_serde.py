"""compression/serde.py: payloads survive proto and bytes unchanged; malformed input raises PayloadError.

Payloads are built by hand from plain bytes in the documented layouts, so these tests need no codec.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwire.compression import serde
from gradwire.compression.config import FORMAT_VERSION, CodecConfig
from gradwire.compression.payload import (
    CompressedGradient,
    CompressedTensor,
    Encoding,
    PayloadError,
    ValueFormat,
)
from gradwire.v1 import codec_pb2


def pack12(indices: list[int]) -> bytes:
    """The documented index layout, written the slow obvious way: two per 3 bytes, ``a | b << 12``."""
    if len(indices) % 2:
        indices = [*indices, 0]
    return b"".join((a | b << 12).to_bytes(3, "little") for a, b in zip(indices[::2], indices[1::2], strict=True))


SETTINGS = CodecConfig(chunk=8, topk=3, use_dct=True, bins=16, range_sigmas=0.1, min_sparse_numel=64)


def pack_bits(codes: list[int], bits: int) -> bytes:
    """The documented value layout, the slow obvious way: an LSB-first stream, code i at bit i * bits."""
    stream = sum(c << (i * bits) for i, c in enumerate(codes))
    return stream.to_bytes((len(codes) * bits + 7) // 8, "little")


# 16 x 8 with 8 x 8 chunks: two chunks, k=3 each, 6 indices. 4-bit bin ids index a 16-entry float16 table.
SPARSE = CompressedTensor(
    name="blocks.0.attn.weight",
    shape=(16, 8),
    encoding=Encoding.SPARSE,
    value_format=ValueFormat.LUT,
    chunk_shape=(8, 8),
    k=3,
    indices=pack12([0, 9, 63, 1, 2, 4095]),
    values=pack_bits([0, 15, 7, 3, 8, 12], 4),
    # Exactly representable in float32, so the proto's float fields carry them unchanged.
    shift=-0.5,
    scale=0.0625,
    lut=struct.pack("<16e", *(i + 0.5 for i in range(16))),
)

# Below min_sparse_numel: sent whole, raw float32, no indices.
DENSE = CompressedTensor(
    name="ln_f.bias",
    shape=(4,),
    encoding=Encoding.DENSE,
    value_format=ValueFormat.FLOAT32,
    chunk_shape=(),
    k=0,
    indices=b"",
    values=struct.pack("<4f", 1.5, -2.25, 0.0, 3e-8),
)

GRADIENT = CompressedGradient(settings=SETTINGS, tensors=(SPARSE, DENSE))

# Sign bits: 8 chunks, k=1, 8 values in one byte; +-scale, no shift, no table.
SIGNED = CompressedTensor(
    name="blocks.0.mlp.weight",
    shape=(64, 8),
    encoding=Encoding.SPARSE,
    value_format=ValueFormat.SIGN,
    chunk_shape=(8, 8),
    k=1,
    indices=pack12([5, 0, 63, 7, 7, 1, 2, 3]),
    values=pack_bits([1, 0, 0, 1, 1, 1, 0, 1], 1),
    scale=0.375,
)
SIGN_GRADIENT = CompressedGradient(settings=dataclasses.replace(SETTINGS, values="sign"), tensors=(SIGNED, DENSE))


def test_pack12_matches_documented_layout() -> None:
    # The helper itself: 0x123 and 0xABC -> 0xABC123 little-endian; odd counts pad with a zero index.
    assert pack12([0x123, 0xABC]) == bytes([0x23, 0xC1, 0xAB])
    assert pack12([0xFFF]) == bytes([0xFF, 0x0F, 0x00])
    assert len(SPARSE.indices) == 9


def test_pack_bits_matches_documented_layout() -> None:
    assert pack_bits([1, 2, 3, 0], 2) == bytes([0b00111001])
    assert SPARSE.values == bytes([0xF0, 0x37, 0xC8])  # 0 | 15 << 4, 7 | 3 << 4, 8 | 12 << 4
    assert SIGNED.values == bytes([0b10111001])


def test_enum_numbers_match_proto() -> None:
    assert {e.name: e.value for e in Encoding} == {
        name.removeprefix("ENCODING_"): number
        for name, number in codec_pb2.Encoding.items()
        if number != codec_pb2.ENCODING_UNSPECIFIED
    }
    assert {e.name: e.value for e in ValueFormat} == {
        name.removeprefix("VALUE_FORMAT_"): number
        for name, number in codec_pb2.ValueFormat.items()
        if number != codec_pb2.VALUE_FORMAT_UNSPECIFIED
    }
    assert {e.name: e.value for e in serde.ValueCoding} == {
        name.removeprefix("VALUE_CODING_"): number
        for name, number in codec_pb2.ValueCoding.items()
        if number != codec_pb2.VALUE_CODING_UNSPECIFIED
    }


def test_proto_fields_carry_payload() -> None:
    msg = serde.gradient_to_proto(GRADIENT)
    assert msg.format_version == FORMAT_VERSION
    assert msg.settings.chunk == 8 and msg.settings.bins == 16 and msg.settings.range_sigmas == 0.1
    assert msg.settings.values == codec_pb2.VALUE_CODING_LUT
    sparse, dense = msg.tensors
    assert sparse.name == SPARSE.name
    assert list(sparse.shape) == [16, 8] and list(sparse.chunk_shape) == [8, 8]
    assert sparse.encoding == codec_pb2.ENCODING_SPARSE
    assert sparse.value_format == codec_pb2.VALUE_FORMAT_LUT
    assert (sparse.indices, sparse.values, sparse.lut) == (SPARSE.indices, SPARSE.values, SPARSE.lut)
    assert (sparse.shift, sparse.scale, sparse.k) == (-0.5, 0.0625, 3)
    assert dense.encoding == codec_pb2.ENCODING_DENSE
    assert dense.value_format == codec_pb2.VALUE_FORMAT_FLOAT32
    assert dense.values == DENSE.values and dense.indices == b"" and not dense.chunk_shape


def test_round_trip_through_proto() -> None:
    back = serde.gradient_from_proto(serde.gradient_to_proto(GRADIENT))
    assert back == GRADIENT
    assert isinstance(back.tensors[0].encoding, Encoding)
    assert isinstance(back.tensors[1].value_format, ValueFormat)
    assert isinstance(back.tensors[0].shape, tuple) and isinstance(back.tensors[1].chunk_shape, tuple)


def test_round_trip_through_bytes() -> None:
    data = serde.gradient_to_bytes(GRADIENT)
    assert isinstance(data, bytes)
    assert serde.gradient_from_bytes(data) == GRADIENT
    # Framing is small next to the tensor data it carries.
    assert GRADIENT.nbytes < len(data) < GRADIENT.nbytes + 200


def test_sign_tensor_round_trip() -> None:
    msg = serde.gradient_to_proto(SIGN_GRADIENT)
    assert msg.settings.values == codec_pb2.VALUE_CODING_SIGN
    sent = msg.tensors[0]
    assert sent.value_format == codec_pb2.VALUE_FORMAT_SIGN
    assert (sent.values, sent.scale, sent.shift, sent.lut) == (SIGNED.values, 0.375, 0.0, b"")
    back = serde.gradient_from_bytes(serde.gradient_to_bytes(SIGN_GRADIENT))
    assert back == SIGN_GRADIENT
    assert back.settings.values == "sign" and back.tensors[0].value_format is ValueFormat.SIGN


def test_round_trip_empty_gradient() -> None:
    empty = CompressedGradient(settings=CodecConfig(), tensors=())
    assert serde.gradient_from_bytes(serde.gradient_to_bytes(empty)) == empty


@given(
    chunk=st.integers(1, 64),
    topk_fraction=st.floats(0, 1),
    use_dct=st.booleans(),
    values=st.sampled_from(["lut", "sign"]),
    bins=st.one_of(st.just(0), st.integers(2, 256)),
    range_sigmas=st.floats(min_value=1e-6, max_value=1e3),
    min_sparse_numel=st.integers(0, 2**40),
)
def test_settings_round_trip_exactly(
    chunk: int,
    topk_fraction: float,
    use_dct: bool,
    values: str,
    bins: int,
    range_sigmas: float,
    min_sparse_numel: int,
) -> None:
    # Exactly, not approximately: receivers compare settings for equality.
    config = CodecConfig(
        chunk=chunk,
        topk=max(1, round(topk_fraction * chunk * chunk)),
        use_dct=use_dct,
        values=values,  # type: ignore[arg-type]
        bins=bins,
        range_sigmas=range_sigmas,
        min_sparse_numel=min_sparse_numel,
    )
    assert serde.settings_from_proto(serde.settings_to_proto(config)) == config


# --- malformed input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"\xff" * 16,  # a varint tag that never ends
        b"not a protobuf message",  # 'n' is field 13 with wire type 6, which does not exist
        b"\x1a\x64\x0a",  # tensors field claiming 100 bytes, 1 present
    ],
)
def test_garbage_bytes_raise(data: bytes) -> None:
    with pytest.raises(PayloadError) as err:
        serde.gradient_from_bytes(data)
    assert err.value.tensor == serde.GRADIENT and err.value.field == "<bytes>"


def test_empty_bytes_raise() -> None:
    # b"" parses as an all-default message: format version 0, no settings.
    with pytest.raises(PayloadError):
        serde.gradient_from_bytes(b"")


def test_truncated_bytes_raise() -> None:
    data = serde.gradient_to_bytes(GRADIENT)
    with pytest.raises(PayloadError):
        serde.gradient_from_bytes(data[:-1])
    with pytest.raises(PayloadError):
        serde.gradient_from_bytes(data[: len(data) // 2])


def test_every_truncation_raises_or_drops_whole_tensors() -> None:
    # Protobuf cannot tell a cut exactly between two tensors from a shorter gradient; any other cut fails.
    # Dropped tensors are the codec validation's to catch, against its plan.
    data = serde.gradient_to_bytes(GRADIENT)
    parsed = 0
    for cut in range(len(data)):
        try:
            got = serde.gradient_from_bytes(data[:cut])
        except PayloadError:
            continue
        parsed += 1
        assert got.settings == GRADIENT.settings
        assert got.tensors == GRADIENT.tensors[: len(got.tensors)] and len(got.tensors) < len(GRADIENT.tensors)
    assert parsed == 2  # no tensors, or the first tensor only


def test_invalid_utf8_name_raises() -> None:
    named = dataclasses.replace(GRADIENT, tensors=(dataclasses.replace(DENSE, name="ab"),))
    data = serde.gradient_to_bytes(named)
    field = b"\x0a\x02ab"  # field 1 (name), length 2
    assert data.count(field) == 1
    with pytest.raises(PayloadError):
        serde.gradient_from_bytes(data.replace(field, b"\x0a\x02\xff\xfe"))


def _with_tensor_field(field: str, number: int) -> bytes:
    msg = serde.gradient_to_proto(GRADIENT)
    setattr(msg.tensors[0], field, number)
    return msg.SerializeToString()


@pytest.mark.parametrize("field", ["encoding", "value_format"])
@pytest.mark.parametrize("number", [0, 6, 99])
def test_unknown_enum_raises(field: str, number: int) -> None:
    data = _with_tensor_field(field, number)
    with pytest.raises(PayloadError) as err:
        serde.gradient_from_bytes(data)
    assert err.value.tensor == SPARSE.name
    assert err.value.field == field
    assert str(number) in err.value.reason


@pytest.mark.parametrize(
    "settings",
    [
        {"chunk": 0},
        {"chunk": 65},
        {"topk": 0},
        {"topk": 65},  # > chunk * chunk for chunk=8
        {"bins": 1},
        {"bins": 300},
        {"range_sigmas": 0.0},
        {"range_sigmas": -1.0},
        {"range_sigmas": math.nan},
        {"range_sigmas": math.inf},
        {"range_sigmas": 1e308},  # finite, but the bin width overflows: NaN in the sender's error feedback
    ],
)
def test_invalid_settings_raise(settings: dict[str, float]) -> None:
    msg = serde.gradient_to_proto(GRADIENT)
    for name, value in settings.items():
        setattr(msg.settings, name, value)
    with pytest.raises(PayloadError) as err:
        serde.gradient_from_bytes(msg.SerializeToString())
    assert err.value.tensor == serde.GRADIENT and err.value.field == "settings"
    assert next(iter(settings)) in err.value.reason  # CodecConfig's message names the setting


@pytest.mark.parametrize("number", [codec_pb2.VALUE_CODING_UNSPECIFIED, 3, 99])
def test_unknown_value_coding_raises(number: int) -> None:
    # 0 is also what a sender from before the setting existed writes: its payloads mean something else.
    msg = serde.gradient_to_proto(GRADIENT)
    msg.settings.values = number
    with pytest.raises(PayloadError) as err:
        serde.gradient_from_bytes(msg.SerializeToString())
    assert err.value.tensor == serde.GRADIENT and err.value.field == "settings"
    assert "ValueCoding" in err.value.reason and str(number) in err.value.reason


def test_missing_settings_raise() -> None:
    msg = serde.gradient_to_proto(GRADIENT)
    msg.ClearField("settings")
    with pytest.raises(PayloadError) as err:
        serde.gradient_from_bytes(msg.SerializeToString())
    assert err.value.field == "settings" and "missing" in err.value.reason


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1])
def test_unknown_format_version_raises(version: int) -> None:
    msg = serde.gradient_to_proto(GRADIENT)
    msg.format_version = version
    with pytest.raises(PayloadError) as err:
        serde.gradient_from_bytes(msg.SerializeToString())
    assert err.value.field == "format_version"


def test_payload_error_is_value_error() -> None:
    # Callers that only know ValueError still catch malformed payloads.
    with pytest.raises(ValueError):
        serde.gradient_from_bytes(b"\xff")
