from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerStatus
    def __init__(self, worker: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerStatus
    def __init__(self, worker: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "state", "running", "waiting", "kv_capacity_tokens")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_JOINING: _ClassVar[WorkerStatus.State]
        STATE_SERVING: _ClassVar[WorkerStatus.State]
        STATE_UNREACHABLE: _ClassVar[WorkerStatus.State]
        STATE_DRAINING: _ClassVar[WorkerStatus.State]
        STATE_LEFT: _ClassVar[WorkerStatus.State]
    STATE_JOINING: WorkerStatus.State
    STATE_SERVING: WorkerStatus.State
    STATE_UNREACHABLE: WorkerStatus.State
    STATE_DRAINING: WorkerStatus.State
    STATE_LEFT: WorkerStatus.State
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: WorkerStatus.State
    running: int
    waiting: int
    kv_capacity_tokens: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[WorkerStatus.State, str]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...
