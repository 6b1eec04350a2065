from mesh.pb import common_pb2 as _common_pb2
from mesh.pb import encoder_pb2 as _encoder_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVPushHeader(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "output_token_ids", "sampling", "cache_salt", "layout", "num_tokens", "num_blocks", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    layout: _common_pb2.KVLayout
    num_tokens: int
    num_blocks: int
    images: _containers.RepeatedCompositeFieldContainer[_encoder_pb2.PromptImage]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_encoder_pb2.PromptImage, _Mapping]]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer", "first_block", "num_blocks", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_block: int
    num_blocks: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVPushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KVPushHeader
    chunk: KVChunk
    def __init__(self, header: _Optional[_Union[KVPushHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("worker_id", "num_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class PushLaneFrame(_message.Message):
    __slots__ = ("header", "chunk", "end", "reserved", "response", "traceparent")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    header: KVPushHeader
    chunk: KVChunk
    end: _common_pb2.LaneEnd
    reserved: PushReserved
    response: PushKVResponse
    traceparent: str
    def __init__(self, header: _Optional[_Union[KVPushHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.LaneEnd, _Mapping]] = ..., reserved: _Optional[_Union[PushReserved, _Mapping]] = ..., response: _Optional[_Union[PushKVResponse, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PushReserved(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_output_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    num_output_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
