from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("protocol_version", "address")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    address: str
    def __init__(self, protocol_version: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("protocol_version", "accepted", "reason", "rejoin_seconds")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REJOIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    accepted: bool
    reason: str
    rejoin_seconds: float
    def __init__(self, protocol_version: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., rejoin_seconds: _Optional[float] = ...) -> None: ...
