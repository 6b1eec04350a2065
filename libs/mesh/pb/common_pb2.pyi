from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_GATEWAY: _ClassVar[Role]
    ROLE_ENCODER: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_KVCACHE: _ClassVar[Role]
    ROLE_BALANCER: _ClassVar[Role]
    ROLE_EXPERT_LB: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
ROLE_UNSPECIFIED: Role
ROLE_GATEWAY: Role
ROLE_ENCODER: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_KVCACHE: Role
ROLE_BALANCER: Role
ROLE_EXPERT_LB: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "structured_output")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "layer_shape", "block_axis", "sections", "block_format", "block_sections")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_AXIS_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FORMAT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SECTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    layer_shape: _containers.RepeatedScalarFieldContainer[int]
    block_axis: int
    sections: KVStateSections
    block_format: int
    block_sections: KVBlockSections
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_shape: _Optional[_Iterable[int]] = ..., block_axis: _Optional[int] = ..., sections: _Optional[_Union[KVStateSections, _Mapping]] = ..., block_format: _Optional[int] = ..., block_sections: _Optional[_Union[KVBlockSections, _Mapping]] = ...) -> None: ...

class KVBlockSections(_message.Message):
    __slots__ = ("kinds", "layer_kinds")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_KINDS_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedCompositeFieldContainer[KVLayerKind]
    layer_kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kinds: _Optional[_Iterable[_Union[KVLayerKind, _Mapping]]] = ..., layer_kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class KVLayerKind(_message.Message):
    __slots__ = ("name", "sections")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    sections: _containers.RepeatedCompositeFieldContainer[KVSection]
    def __init__(self, name: _Optional[str] = ..., sections: _Optional[_Iterable[_Union[KVSection, _Mapping]]] = ...) -> None: ...

class KVSection(_message.Message):
    __slots__ = ("name", "rows", "width")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    width: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class KVStateSections(_message.Message):
    __slots__ = ("layer_kinds", "head_dim", "index_head_dim", "sliding_window", "csa_ratio", "hca_ratio")
    LAYER_KINDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CSA_RATIO_FIELD_NUMBER: _ClassVar[int]
    HCA_RATIO_FIELD_NUMBER: _ClassVar[int]
    layer_kinds: _containers.RepeatedScalarFieldContainer[str]
    head_dim: int
    index_head_dim: int
    sliding_window: int
    csa_ratio: int
    hca_ratio: int
    def __init__(self, layer_kinds: _Optional[_Iterable[str]] = ..., head_dim: _Optional[int] = ..., index_head_dim: _Optional[int] = ..., sliding_window: _Optional[int] = ..., csa_ratio: _Optional[int] = ..., hca_ratio: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "models", "max_num_seqs", "num_kv_blocks", "block_size", "data_address", "started_at_ms", "version", "model_block_sizes")
    class ModelBlockSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    address: str
    models: _containers.RepeatedScalarFieldContainer[str]
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    data_address: str
    started_at_ms: int
    version: str
    model_block_sizes: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., max_num_seqs: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., data_address: _Optional[str] = ..., started_at_ms: _Optional[int] = ..., version: _Optional[str] = ..., model_block_sizes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class LaneEnd(_message.Message):
    __slots__ = ("error", "code")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    error: str
    code: int
    def __init__(self, error: _Optional[str] = ..., code: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_kv_blocks", "kv_usage", "num_kv_tokens", "num_queued_prompt_tokens", "num_cached_blocks")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    kv_usage: float
    num_kv_tokens: int
    num_queued_prompt_tokens: int
    num_cached_blocks: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_kv_tokens: _Optional[int] = ..., num_queued_prompt_tokens: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...
