from gradwire.v1 import codec_pb2 as _codec_pb2
from gradwire.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogRecord(_message.Message):
    __slots__ = ("round", "from_version", "to_version", "update", "fingerprint", "coordinator_state", "contributions", "gossip", "received", "update_received", "contributions_received")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    round: int
    from_version: int
    to_version: int
    update: _worker_pb2.StateUpdate
    fingerprint: _worker_pb2.Fingerprint
    coordinator_state: bytes
    contributions: _worker_pb2.StateUpdate
    gossip: GossipRound
    received: _containers.RepeatedCompositeFieldContainer[_codec_pb2.CompressedGradient]
    update_received: _containers.RepeatedScalarFieldContainer[int]
    contributions_received: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., update: _Optional[_Union[_worker_pb2.StateUpdate, _Mapping]] = ..., fingerprint: _Optional[_Union[_worker_pb2.Fingerprint, _Mapping]] = ..., coordinator_state: _Optional[bytes] = ..., contributions: _Optional[_Union[_worker_pb2.StateUpdate, _Mapping]] = ..., gossip: _Optional[_Union[GossipRound, _Mapping]] = ..., received: _Optional[_Iterable[_Union[_codec_pb2.CompressedGradient, _Mapping]]] = ..., update_received: _Optional[_Iterable[int]] = ..., contributions_received: _Optional[_Iterable[int]] = ...) -> None: ...

class GossipRound(_message.Message):
    __slots__ = ("accepted", "sketches", "state")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SKETCHES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedCompositeFieldContainer[GossipMessage]
    sketches: _containers.RepeatedCompositeFieldContainer[MemberSketch]
    state: bytes
    def __init__(self, accepted: _Optional[_Iterable[_Union[GossipMessage, _Mapping]]] = ..., sketches: _Optional[_Iterable[_Union[MemberSketch, _Mapping]]] = ..., state: _Optional[bytes] = ...) -> None: ...

class GossipMessage(_message.Message):
    __slots__ = ("member", "round", "message", "digest", "nbytes")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    member: str
    round: int
    message: _codec_pb2.CompressedGradient
    digest: bytes
    nbytes: int
    def __init__(self, member: _Optional[str] = ..., round: _Optional[int] = ..., message: _Optional[_Union[_codec_pb2.CompressedGradient, _Mapping]] = ..., digest: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class MemberSketch(_message.Message):
    __slots__ = ("member", "values")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    member: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, member: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...
