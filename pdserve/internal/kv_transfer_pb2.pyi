from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PushAck(_message.Message):
    __slots__ = ("ok", "error", "bytes_received")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    bytes_received: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...
