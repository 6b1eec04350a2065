from mesh.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "block_hashes", "num_prompt_tokens", "tenant", "traffic_class", "exclude_worker_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    tenant: str
    traffic_class: str
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("prefill", "decode", "num_cached_tokens")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill: _common_pb2.WorkerInfo
    decode: _common_pb2.WorkerInfo
    num_cached_tokens: int
    def __init__(self, prefill: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker", "load", "last_seen_ms")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    last_seen_ms: int
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., last_seen_ms: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...
