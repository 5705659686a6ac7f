from gradwire.v1 import worker_pb2 as _worker_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogRecord(_message.Message):
    __slots__ = ("round", "from_version", "to_version", "update", "fingerprint", "coordinator_state", "contributions")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    round: int
    from_version: int
    to_version: int
    update: _worker_pb2.StateUpdate
    fingerprint: _worker_pb2.Fingerprint
    coordinator_state: bytes
    contributions: _worker_pb2.StateUpdate
    def __init__(self, round: _Optional[int] = ..., from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., update: _Optional[_Union[_worker_pb2.StateUpdate, _Mapping]] = ..., fingerprint: _Optional[_Union[_worker_pb2.Fingerprint, _Mapping]] = ..., coordinator_state: _Optional[bytes] = ..., contributions: _Optional[_Union[_worker_pb2.StateUpdate, _Mapping]] = ...) -> None: ...
