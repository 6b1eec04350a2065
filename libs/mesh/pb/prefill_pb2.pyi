from mesh.pb import common_pb2 as _common_pb2
from mesh.pb import encoder_pb2 as _encoder_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "cache_salt", "decode_address", "decode_worker_id", "traffic_class", "images", "decode_data_address", "output_token_ids", "exclude_decode_worker_ids", "canary")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    DECODE_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_DECODE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    decode_address: str
    decode_worker_id: str
    traffic_class: str
    images: _containers.RepeatedCompositeFieldContainer[_encoder_pb2.PromptImage]
    decode_data_address: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    exclude_decode_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    canary: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., decode_address: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., traffic_class: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_encoder_pb2.PromptImage, _Mapping]]] = ..., decode_data_address: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., exclude_decode_worker_ids: _Optional[_Iterable[str]] = ..., canary: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("worker_id", "first_token_id", "first_logprob", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "num_store_tokens", "prefill_seconds", "kv_bytes_sent", "kv_pending", "decode_worker_id", "decode_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_PENDING_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    num_store_tokens: int
    prefill_seconds: float
    kv_bytes_sent: int
    kv_pending: bool
    decode_worker_id: str
    decode_address: str
    def __init__(self, worker_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_store_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., kv_bytes_sent: _Optional[int] = ..., kv_pending: _Optional[bool] = ..., decode_worker_id: _Optional[str] = ..., decode_address: _Optional[str] = ...) -> None: ...
