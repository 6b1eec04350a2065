"""Block keys: a block's key chains its parent's key with its token ids and extra keys.

Equal keys mean equal KV, in any process on any machine: the hash is SHA-256 over a fixed byte encoding
(never Python's `hash()`, which is salted per process). The chain starts from a root key built from the
model's name and the request's cache salt, so two models, or two tenants with different salts, never
share a block even for identical tokens. Positions whose KV depends on more than their tokens (an image's
embeddings at its placeholder tokens) are given as key spans: every block a span touches carries the span's key
(the image's content hash) and where the span lies in the block, so a cached block is reused only for the
same image at the same place.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

BlockHash = bytes  # a 32-byte SHA-256 digest
ExtraKey = str | bytes | int


def _encode_extra(keys: Sequence[ExtraKey]) -> bytes:
    parts = []
    for key in keys:
        if isinstance(key, int):
            raw, tag = struct.pack("<q", key), b"i"
        elif isinstance(key, str):
            raw, tag = key.encode(), b"s"
        else:
            raw, tag = bytes(key), b"b"
        parts.append(tag + struct.pack("<I", len(raw)) + raw)
    return b"".join(parts)


class KeySpan(NamedTuple):
    """Prompt positions [start, end) whose KV depends on `key` besides their token ids."""

    start: int
    end: int
    key: bytes


def span_extra_keys(spans: Sequence[KeySpan], block_start: int, block_end: int) -> list[ExtraKey]:
    """The extra keys of the block holding positions [block_start, block_end): each overlapping span's key and
    its bounds relative to the block."""
    keys: list[ExtraKey] = []
    for span in spans:
        if span.start < block_end and span.end > block_start:
            keys += [span.key, span.start - block_start, span.end - block_start]
    return keys


def root_hash(model: str, cache_salt: str | None = None) -> BlockHash:
    """The parent key of every request's first block."""
    return hashlib.sha256(b"kvmesh/v1\0" + _encode_extra([model, cache_salt or ""])).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """The key of a block holding `token_ids`, whose prefix has key `parent`."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    if extra_keys:
        h.update(_encode_extra(extra_keys))
    return h.digest()


def hash_token_blocks(
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[BlockHash] = (),
    key_spans: Sequence[KeySpan] = (),
) -> list[BlockHash]:
    """Keys of every full block of `token_ids`, reusing the `known` keys of its first blocks."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        extra = span_extra_keys(key_spans, start, start + block_size) if key_spans else ()
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
