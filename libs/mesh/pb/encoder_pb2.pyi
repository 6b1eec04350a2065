from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "model", "image")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    image: bytes
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., image: _Optional[bytes] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("image_hash", "num_tokens", "hidden_size", "dtype", "embeddings", "cached")
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    image_hash: bytes
    num_tokens: int
    hidden_size: int
    dtype: str
    embeddings: bytes
    cached: bool
    def __init__(self, image_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., embeddings: _Optional[bytes] = ..., cached: _Optional[bool] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("image_hash", "offset", "num_tokens", "hidden_size", "dtype", "embeddings")
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    image_hash: bytes
    offset: int
    num_tokens: int
    hidden_size: int
    dtype: str
    embeddings: bytes
    def __init__(self, image_hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., embeddings: _Optional[bytes] = ...) -> None: ...
