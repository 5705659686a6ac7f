from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    ENCODING_SPARSE: _ClassVar[Encoding]
    ENCODING_DENSE: _ClassVar[Encoding]
    ENCODING_LOW_RANK: _ClassVar[Encoding]

class ValueFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_FORMAT_UNSPECIFIED: _ClassVar[ValueFormat]
    VALUE_FORMAT_FLOAT32: _ClassVar[ValueFormat]
    VALUE_FORMAT_LUT: _ClassVar[ValueFormat]
    VALUE_FORMAT_SIGN: _ClassVar[ValueFormat]
    VALUE_FORMAT_INT8: _ClassVar[ValueFormat]
    VALUE_FORMAT_INT4: _ClassVar[ValueFormat]

class ValueCoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_CODING_UNSPECIFIED: _ClassVar[ValueCoding]
    VALUE_CODING_LUT: _ClassVar[ValueCoding]
    VALUE_CODING_SIGN: _ClassVar[ValueCoding]

class IndexCoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_CODING_UNSPECIFIED: _ClassVar[IndexCoding]
    INDEX_CODING_PACKED12: _ClassVar[IndexCoding]
    INDEX_CODING_ELIAS_FANO: _ClassVar[IndexCoding]
ENCODING_UNSPECIFIED: Encoding
ENCODING_SPARSE: Encoding
ENCODING_DENSE: Encoding
ENCODING_LOW_RANK: Encoding
VALUE_FORMAT_UNSPECIFIED: ValueFormat
VALUE_FORMAT_FLOAT32: ValueFormat
VALUE_FORMAT_LUT: ValueFormat
VALUE_FORMAT_SIGN: ValueFormat
VALUE_FORMAT_INT8: ValueFormat
VALUE_FORMAT_INT4: ValueFormat
VALUE_CODING_UNSPECIFIED: ValueCoding
VALUE_CODING_LUT: ValueCoding
VALUE_CODING_SIGN: ValueCoding
INDEX_CODING_UNSPECIFIED: IndexCoding
INDEX_CODING_PACKED12: IndexCoding
INDEX_CODING_ELIAS_FANO: IndexCoding

class CodecSettings(_message.Message):
    __slots__ = ("chunk", "topk", "use_dct", "bins", "range_sigmas", "min_sparse_numel", "values", "indices", "rank", "rank_fits_topk", "factor_bits")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    USE_DCT_FIELD_NUMBER: _ClassVar[int]
    BINS_FIELD_NUMBER: _ClassVar[int]
    RANGE_SIGMAS_FIELD_NUMBER: _ClassVar[int]
    MIN_SPARSE_NUMEL_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FITS_TOPK_FIELD_NUMBER: _ClassVar[int]
    FACTOR_BITS_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    topk: int
    use_dct: bool
    bins: int
    range_sigmas: float
    min_sparse_numel: int
    values: ValueCoding
    indices: IndexCoding
    rank: int
    rank_fits_topk: bool
    factor_bits: int
    def __init__(self, chunk: _Optional[int] = ..., topk: _Optional[int] = ..., use_dct: _Optional[bool] = ..., bins: _Optional[int] = ..., range_sigmas: _Optional[float] = ..., min_sparse_numel: _Optional[int] = ..., values: _Optional[_Union[ValueCoding, str]] = ..., indices: _Optional[_Union[IndexCoding, str]] = ..., rank: _Optional[int] = ..., rank_fits_topk: _Optional[bool] = ..., factor_bits: _Optional[int] = ...) -> None: ...

class CompressedTensor(_message.Message):
    __slots__ = ("name", "shape", "encoding", "value_format", "chunk_shape", "k", "indices", "values", "shift", "scale", "lut")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    VALUE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    LUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: Encoding
    value_format: ValueFormat
    chunk_shape: _containers.RepeatedScalarFieldContainer[int]
    k: int
    indices: bytes
    values: bytes
    shift: float
    scale: float
    lut: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., value_format: _Optional[_Union[ValueFormat, str]] = ..., chunk_shape: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., indices: _Optional[bytes] = ..., values: _Optional[bytes] = ..., shift: _Optional[float] = ..., scale: _Optional[float] = ..., lut: _Optional[bytes] = ...) -> None: ...

class CompressedGradient(_message.Message):
    __slots__ = ("format_version", "settings", "tensors")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    settings: CodecSettings
    tensors: _containers.RepeatedCompositeFieldContainer[CompressedTensor]
    def __init__(self, format_version: _Optional[int] = ..., settings: _Optional[_Union[CodecSettings, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[CompressedTensor, _Mapping]]] = ...) -> None: ...
