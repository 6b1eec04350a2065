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
    __slots__ = ("prefill", "decode", "num_cached_tokens", "predicted_ttft_s", "canary")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    prefill: _common_pb2.WorkerInfo
    decode: _common_pb2.WorkerInfo
    num_cached_tokens: int
    predicted_ttft_s: float
    canary: bool
    def __init__(self, prefill: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., predicted_ttft_s: _Optional[float] = ..., canary: _Optional[bool] = ...) -> None: ...

class BindDecodeRequest(_message.Message):
    __slots__ = ("request_id", "model", "num_kv_tokens", "canary", "exclude_worker_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    num_kv_tokens: int
    canary: bool
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., num_kv_tokens: _Optional[int] = ..., canary: _Optional[bool] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BindDecodeResponse(_message.Message):
    __slots__ = ("decode",)
    DECODE_FIELD_NUMBER: _ClassVar[int]
    decode: _common_pb2.WorkerInfo
    def __init__(self, decode: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class RouteEncoderRequest(_message.Message):
    __slots__ = ("request_id", "model", "image_hash", "exclude_worker_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    image_hash: bytes
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., image_hash: _Optional[bytes] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteEncoderResponse(_message.Message):
    __slots__ = ("encoder",)
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    encoder: _common_pb2.WorkerInfo
    def __init__(self, encoder: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("workers", "pools")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "num_workers", "num_recommended", "utilization", "target_utilization")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMMENDED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    pool: str
    num_workers: int
    num_recommended: int
    utilization: float
    target_utilization: float
    def __init__(self, pool: _Optional[str] = ..., num_workers: _Optional[int] = ..., num_recommended: _Optional[int] = ..., utilization: _Optional[float] = ..., target_utilization: _Optional[float] = ...) -> None: ...

class ReplicaRecommendation(_message.Message):
    __slots__ = ("balancer_id", "timestamp_ms", "pools")
    BALANCER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    balancer_id: str
    timestamp_ms: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, balancer_id: _Optional[str] = ..., timestamp_ms: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("balancer_id", "request_id", "assigned_s", "prefill_worker_id", "decode_worker_id", "num_prompt_tokens", "num_uncached_tokens", "prefill_s", "decode_arrival_s", "block_hashes")
    BALANCER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    balancer_id: str
    request_id: str
    assigned_s: float
    prefill_worker_id: str
    decode_worker_id: str
    num_prompt_tokens: int
    num_uncached_tokens: int
    prefill_s: float
    decode_arrival_s: float
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, balancer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., assigned_s: _Optional[float] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_uncached_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., decode_arrival_s: _Optional[float] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
