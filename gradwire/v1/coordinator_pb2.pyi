from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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

class TunnelFrame(_message.Message):
    __slots__ = ("call", "hello", "open", "message", "half_close", "status", "cancel")
    CALL_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HALF_CLOSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call: int
    hello: TunnelHello
    open: TunnelOpen
    message: bytes
    half_close: bool
    status: TunnelStatus
    cancel: bool
    def __init__(self, call: _Optional[int] = ..., hello: _Optional[_Union[TunnelHello, _Mapping]] = ..., open: _Optional[_Union[TunnelOpen, _Mapping]] = ..., message: _Optional[bytes] = ..., half_close: _Optional[bool] = ..., status: _Optional[_Union[TunnelStatus, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class TunnelHello(_message.Message):
    __slots__ = ("protocol_version", "name")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    name: str
    def __init__(self, protocol_version: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class TunnelOpen(_message.Message):
    __slots__ = ("method", "timeout_seconds", "metadata")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    method: str
    timeout_seconds: float
    metadata: _containers.RepeatedCompositeFieldContainer[TunnelMetadata]
    def __init__(self, method: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., metadata: _Optional[_Iterable[_Union[TunnelMetadata, _Mapping]]] = ...) -> None: ...

class TunnelMetadata(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class TunnelStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...
