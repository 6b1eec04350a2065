from mesh.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerHeartbeat(_message.Message):
    __slots__ = ("worker", "load", "timestamp_ms", "leaving")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    timestamp_ms: int
    leaving: bool
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., timestamp_ms: _Optional[int] = ..., leaving: _Optional[bool] = ...) -> None: ...

class KVBlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "block_size", "model", "fragment_indices", "num_data_fragments", "num_fragments")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_DATA_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    block_size: int
    model: str
    fragment_indices: _containers.RepeatedScalarFieldContainer[int]
    num_data_fragments: int
    num_fragments: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., fragment_indices: _Optional[_Iterable[int]] = ..., num_data_fragments: _Optional[int] = ..., num_fragments: _Optional[int] = ...) -> None: ...

class KVBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "model", "reason")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    reason: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KVBlocksStored
    removed: KVBlocksRemoved
    all_cleared: bool
    def __init__(self, stored: _Optional[_Union[KVBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KVBlocksRemoved, _Mapping]] = ..., all_cleared: _Optional[bool] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "seq", "tier", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    tier: str
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., tier: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class RequestFinished(_message.Message):
    __slots__ = ("request_id", "worker_id", "model", "num_kv_tokens", "num_output_tokens", "finish_reason", "timestamp_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    model: str
    num_kv_tokens: int
    num_output_tokens: int
    finish_reason: str
    timestamp_ms: int
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_kv_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class KVIndexSnapshot(_message.Message):
    __slots__ = ("stream_seq", "workers", "codings", "timestamp_ms")
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CODINGS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    stream_seq: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerHoldings]
    codings: _containers.RepeatedCompositeFieldContainer[BlockCoding]
    timestamp_ms: int
    def __init__(self, stream_seq: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerHoldings, _Mapping]]] = ..., codings: _Optional[_Iterable[_Union[BlockCoding, _Mapping]]] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class WorkerHoldings(_message.Message):
    __slots__ = ("worker_id", "last_seq", "block_hashes", "fragment_indices", "tier_masks", "coding_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    TIER_MASKS_FIELD_NUMBER: _ClassVar[int]
    CODING_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    last_seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    fragment_indices: _containers.RepeatedScalarFieldContainer[int]
    tier_masks: _containers.RepeatedScalarFieldContainer[int]
    coding_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., last_seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., fragment_indices: _Optional[_Iterable[int]] = ..., tier_masks: _Optional[_Iterable[int]] = ..., coding_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCoding(_message.Message):
    __slots__ = ("num_data", "num_total")
    NUM_DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_data: int
    num_total: int
    def __init__(self, num_data: _Optional[int] = ..., num_total: _Optional[int] = ...) -> None: ...

class UsageRecord(_message.Message):
    __slots__ = ("request_id", "tenant_id", "key_id", "model", "api", "status", "http_status", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "e2e_ms", "prefill_worker", "decode_worker", "cost", "price_plan", "started_at_ms", "ended_at_ms", "gateway_id", "gateway_started_at_ms", "settle_after_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PRICE_PLAN_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SETTLE_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    api: str
    status: str
    http_status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    e2e_ms: float
    prefill_worker: str
    decode_worker: str
    cost: str
    price_plan: str
    started_at_ms: int
    ended_at_ms: int
    gateway_id: str
    gateway_started_at_ms: int
    settle_after_ms: int
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., key_id: _Optional[str] = ..., model: _Optional[str] = ..., api: _Optional[str] = ..., status: _Optional[str] = ..., http_status: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., cost: _Optional[str] = ..., price_plan: _Optional[str] = ..., started_at_ms: _Optional[int] = ..., ended_at_ms: _Optional[int] = ..., gateway_id: _Optional[str] = ..., gateway_started_at_ms: _Optional[int] = ..., settle_after_ms: _Optional[int] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("rollout_id", "model", "stable_version", "canary_version", "steps", "check_interval_s", "gates", "state", "step_index", "weight", "created_ms", "step_started_ms", "decisions", "checked_ms", "quality")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECK_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    GATES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_MS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    model: str
    stable_version: str
    canary_version: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    check_interval_s: float
    gates: RolloutGates
    state: str
    step_index: int
    weight: int
    created_ms: int
    step_started_ms: int
    decisions: _containers.RepeatedCompositeFieldContainer[RolloutDecision]
    checked_ms: int
    quality: QualityOutcome
    def __init__(self, rollout_id: _Optional[str] = ..., model: _Optional[str] = ..., stable_version: _Optional[str] = ..., canary_version: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., check_interval_s: _Optional[float] = ..., gates: _Optional[_Union[RolloutGates, _Mapping]] = ..., state: _Optional[str] = ..., step_index: _Optional[int] = ..., weight: _Optional[int] = ..., created_ms: _Optional[int] = ..., step_started_ms: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[RolloutDecision, _Mapping]]] = ..., checked_ms: _Optional[int] = ..., quality: _Optional[_Union[QualityOutcome, _Mapping]] = ...) -> None: ...

class QualityOutcome(_message.Message):
    __slots__ = ("result", "reason", "at_ms")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    result: str
    reason: str
    at_ms: int
    def __init__(self, result: _Optional[str] = ..., reason: _Optional[str] = ..., at_ms: _Optional[int] = ...) -> None: ...

class RolloutGates(_message.Message):
    __slots__ = ("max_ttft_p95_ratio", "max_itl_p95_ratio", "max_error_rate_increase", "max_cost_per_token_ratio", "min_samples", "quality_prompts", "quality_max_tokens")
    MAX_TTFT_P95_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAX_ITL_P95_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_RATE_INCREASE_FIELD_NUMBER: _ClassVar[int]
    MAX_COST_PER_TOKEN_RATIO_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    QUALITY_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_ttft_p95_ratio: float
    max_itl_p95_ratio: float
    max_error_rate_increase: float
    max_cost_per_token_ratio: float
    min_samples: int
    quality_prompts: _containers.RepeatedCompositeFieldContainer[QualityPrompt]
    quality_max_tokens: int
    def __init__(self, max_ttft_p95_ratio: _Optional[float] = ..., max_itl_p95_ratio: _Optional[float] = ..., max_error_rate_increase: _Optional[float] = ..., max_cost_per_token_ratio: _Optional[float] = ..., min_samples: _Optional[int] = ..., quality_prompts: _Optional[_Iterable[_Union[QualityPrompt, _Mapping]]] = ..., quality_max_tokens: _Optional[int] = ...) -> None: ...

class QualityPrompt(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RolloutDecision(_message.Message):
    __slots__ = ("at_ms", "action", "weight", "reason")
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at_ms: int
    action: str
    weight: int
    reason: str
    def __init__(self, at_ms: _Optional[int] = ..., action: _Optional[str] = ..., weight: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
