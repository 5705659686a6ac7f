"""Protobuf serde for the codec: the one place the payload dataclasses meet ``gradwire.v1.codec_pb2``.

Each ``*_to_proto`` has a paired ``*_from_proto``; ``gradient_to_bytes``/``gradient_from_bytes`` add the
wire encoding. Everything else in gradwire works with the plain dataclasses of ``payload.py``.

``*_from_proto`` trusts nothing that arrived over the network: an unparseable message, an enum number this
version does not know (including the proto3 default 0, UNSPECIFIED), missing or invalid settings, or an
unknown format version raise ``PayloadError`` naming the tensor and field. What this module does *not*
check is whether the tensors fit a model (names, shapes, chunk shapes, ``k``, byte lengths, index ranges):
only the codec knows its chunk plan, so its validation does that.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from google.protobuf.message import DecodeError

from gradwire.compression.config import FORMAT_VERSION, CodecConfig
from gradwire.compression.payload import (
    GRADIENT,
    CompressedGradient,
    CompressedTensor,
    Encoding,
    PayloadError,
    ValueFormat,
)
from gradwire.v1 import codec_pb2

_E = TypeVar("_E", bound=enum.IntEnum)


def _enum_from_proto(cls: type[_E], number: int, tensor: str, field: str) -> _E:
    # proto3 enums are open: an unknown number parses fine and arrives as a plain int, so check it here.
    try:
        return cls(number)
    except ValueError:
        known = ", ".join(f"{m.value} ({m.name})" for m in cls)
        raise PayloadError(tensor, field, f"unknown {cls.__name__} {number}; expected one of {known}") from None


# --- settings -------------------------------------------------------------------------------------------


class ValueCoding(enum.IntEnum):
    """``CodecConfig.values`` as the proto enum ``ValueCoding``: a member's name, lowercased, is the setting."""

    LUT = 1
    SIGN = 2


class IndexCoding(enum.IntEnum):
    """``CodecConfig.indices`` as the proto enum ``IndexCoding``: a member's name, lowercased with "-" for
    "_", is the setting."""

    PACKED12 = 1
    ELIAS_FANO = 2


def settings_to_proto(config: CodecConfig) -> codec_pb2.CodecSettings:
    return codec_pb2.CodecSettings(
        chunk=config.chunk,
        topk=config.topk,
        use_dct=config.use_dct,
        values=int(ValueCoding[config.values.upper()]),
        bins=config.bins,
        range_sigmas=config.range_sigmas,
        min_sparse_numel=config.min_sparse_numel,
        indices=int(IndexCoding[config.indices.upper().replace("-", "_")]),
        rank=config.rank,
        rank_fits_topk=config.rank_fits_topk,
        factor_bits=config.factor_bits,
    )


def settings_from_proto(msg: codec_pb2.CodecSettings) -> CodecConfig:
    values = _enum_from_proto(ValueCoding, msg.values, GRADIENT, "settings")
    indices = _enum_from_proto(IndexCoding, msg.indices, GRADIENT, "settings")
    try:
        return CodecConfig(
            chunk=msg.chunk,
            topk=msg.topk,
            use_dct=msg.use_dct,
            values=values.name.lower(),  # type: ignore[arg-type]  # a member of VALUE_CODINGS
            bins=msg.bins,
            range_sigmas=msg.range_sigmas,
            min_sparse_numel=msg.min_sparse_numel,
            indices=indices.name.lower().replace("_", "-"),  # type: ignore[arg-type]  # one of INDEX_CODINGS
            rank=msg.rank,
            rank_fits_topk=msg.rank_fits_topk,
            factor_bits=msg.factor_bits or 8,  # 0: a sender from before int4 factors
        )
    except ValueError as e:  # CodecConfig.__post_init__ names the offending setting
        raise PayloadError(GRADIENT, "settings", str(e)) from None


# --- tensor ---------------------------------------------------------------------------------------------


def tensor_to_proto(tensor: CompressedTensor) -> codec_pb2.CompressedTensor:
    return codec_pb2.CompressedTensor(
        name=tensor.name,
        shape=tensor.shape,
        encoding=int(tensor.encoding),
        value_format=int(tensor.value_format),
        chunk_shape=tensor.chunk_shape,
        k=tensor.k,
        indices=tensor.indices,
        values=tensor.values,
        # float32 on the wire: the codec computes shift and scale in float32, so nothing is lost.
        shift=tensor.shift,
        scale=tensor.scale,
        lut=tensor.lut,
    )


def tensor_from_proto(msg: codec_pb2.CompressedTensor) -> CompressedTensor:
    return CompressedTensor(
        name=msg.name,
        shape=tuple(msg.shape),
        encoding=_enum_from_proto(Encoding, msg.encoding, msg.name, "encoding"),
        value_format=_enum_from_proto(ValueFormat, msg.value_format, msg.name, "value_format"),
        chunk_shape=tuple(msg.chunk_shape),
        k=msg.k,
        indices=msg.indices,
        values=msg.values,
        shift=msg.shift,
        scale=msg.scale,
        lut=msg.lut,
    )


# --- gradient -------------------------------------------------------------------------------------------


def gradient_to_proto(gradient: CompressedGradient) -> codec_pb2.CompressedGradient:
    return codec_pb2.CompressedGradient(
        format_version=gradient.format_version,
        settings=settings_to_proto(gradient.settings),
        tensors=[tensor_to_proto(t) for t in gradient.tensors],
    )


def gradient_from_proto(msg: codec_pb2.CompressedGradient) -> CompressedGradient:
    # Check the version first: under another version the other fields may mean something else.
    if msg.format_version != FORMAT_VERSION:
        raise PayloadError(
            GRADIENT, "format_version", f"unknown format version {msg.format_version}; expected {FORMAT_VERSION}"
        )
    # A missing message field reads as all defaults (chunk=0, ...); say what actually happened instead.
    if not msg.HasField("settings"):
        raise PayloadError(GRADIENT, "settings", "missing")
    return CompressedGradient(
        settings=settings_from_proto(msg.settings),
        tensors=tuple(tensor_from_proto(t) for t in msg.tensors),
        format_version=msg.format_version,
    )


def gradient_to_bytes(gradient: CompressedGradient) -> bytes:
    return gradient_to_proto(gradient).SerializeToString()


def gradient_from_bytes(data: bytes) -> CompressedGradient:
    """Parse and check a serialized ``CompressedGradient``; raise ``PayloadError`` on anything malformed.

    Protobuf cannot tell every truncation from a shorter message: bytes cut exactly between two tensors
    parse as a gradient with fewer tensors. The codec's validation catches that against its plan.
    """
    msg = codec_pb2.CompressedGradient()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise PayloadError(GRADIENT, "<bytes>", f"not a CompressedGradient message ({len(data)} bytes): {e}") from None
    return gradient_from_proto(msg)
