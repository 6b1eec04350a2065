from mesh.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Block(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "layout", "data")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    layout: _common_pb2.KVLayout
    data: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_present")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_present: int
    def __init__(self, num_stored: _Optional[int] = ..., num_present: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("block_hashes", "model")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "model")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hits",)
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    def __init__(self, num_hits: _Optional[int] = ...) -> None: ...
