from mesh.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaneFrame(_message.Message):
    __slots__ = ("request", "block", "end", "put_response", "traceparent")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PUT_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request: GetRequest
    block: Block
    end: _common_pb2.LaneEnd
    put_response: PutResponse
    traceparent: str
    def __init__(self, request: _Optional[_Union[GetRequest, _Mapping]] = ..., block: _Optional[_Union[Block, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.LaneEnd, _Mapping]] = ..., put_response: _Optional[_Union[PutResponse, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "layout", "data", "checksum", "block_checksum", "fragment_index", "num_data_fragments", "num_fragments", "traffic_class", "tier", "offset", "first_block")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_DATA_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    layout: _common_pb2.KVLayout
    data: bytes
    checksum: int
    block_checksum: int
    fragment_index: int
    num_data_fragments: int
    num_fragments: int
    traffic_class: str
    tier: str
    offset: int
    first_block: int
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., block_checksum: _Optional[int] = ..., fragment_index: _Optional[int] = ..., num_data_fragments: _Optional[int] = ..., num_fragments: _Optional[int] = ..., traffic_class: _Optional[str] = ..., tier: _Optional[str] = ..., offset: _Optional[int] = ..., first_block: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_present")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_present: int
    def __init__(self, num_stored: _Optional[int] = ..., num_present: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("block_hashes", "model", "skip_missing", "slice_bytes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SKIP_MISSING_FIELD_NUMBER: _ClassVar[int]
    SLICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    skip_missing: bool
    slice_bytes: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ..., skip_missing: _Optional[bool] = ..., slice_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "model", "per_block")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    per_block: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ..., per_block: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hits", "fragment_indices")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    fragment_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_hits: _Optional[int] = ..., fragment_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("block_hashes", "model", "ttl_seconds")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    ttl_seconds: float
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_pinned",)
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    num_pinned: int
    def __init__(self, num_pinned: _Optional[int] = ...) -> None: ...
