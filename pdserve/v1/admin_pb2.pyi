from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleRequest(_message.Message):
    __slots__ = ("prefill", "decode", "drain_timeout_s")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    drain_timeout_s: float
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("num_prefill_workers", "num_decode_workers", "added", "removed", "num_requests_cut")
    NUM_PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_CUT_FIELD_NUMBER: _ClassVar[int]
    num_prefill_workers: int
    num_decode_workers: int
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    num_requests_cut: int
    def __init__(self, num_prefill_workers: _Optional[int] = ..., num_decode_workers: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., num_requests_cut: _Optional[int] = ...) -> None: ...
