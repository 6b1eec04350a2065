"""A store node's tiers: `MemoryTier` (host memory) and `FileTier` (one file per block in a data directory on
SSD, surviving a restart). Each holds values by key within a byte capacity and owns its eviction policy; the
`BlockStore` is the only writer of both and decides what moves between them.

A block file is `KVMB` + u32 header length + the header (kvcache.proto's Block without its data) + the data,
written to a temporary name and renamed, so a crash leaves either the whole file or none. On start `scan()` reads
the headers only (oldest file first); the data is read, and its checksum checked, when the block is asked for.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from google.protobuf.message import DecodeError

from mesh.eviction.policies import EvictionPolicy
from mesh.kv_blocks import checksum
from mesh.pb import kvcache_pb2
from services.kvcache import codec
from services.kvcache.blocks import Block

MAGIC = b"KVMB"
SUFFIX = ".blk"


class MemoryTier:
    name = "host"

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._blocks: dict[bytes, Block] = {}
        self.num_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def meta(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def read(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def add(self, block: Block) -> None:
        assert block.block_hash not in self._blocks
        self._blocks[block.block_hash] = block
        self.num_bytes += len(block.data)

    def drop(self, key: bytes) -> Block | None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.num_bytes -= len(block.data)
        return block

    def keys(self) -> Iterator[bytes]:
        return iter(self._blocks)


@dataclass(frozen=True)
class _FileEntry:
    meta: Block  # without data
    num_bytes: int
    mtime: float


class FileTier:
    name = "ssd"

    def __init__(self, root: Path, capacity_bytes: int, policy: EvictionPolicy) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._entries: dict[bytes, _FileEntry] = {}
        self.num_bytes = 0
        root.mkdir(parents=True, exist_ok=True)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    def meta(self, key: bytes) -> Block | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.meta

    def mtime(self, key: bytes) -> float:
        return self._entries[key].mtime

    def add(self, block: Block) -> None:
        assert block.block_hash not in self._entries and block.checksum is not None
        path = self.path(block.block_hash)
        path.parent.mkdir(exist_ok=True)
        header = codec.block_to_pb(block.without_data()).SerializeToString()
        temporary = path.with_suffix(".tmp")
        with temporary.open("wb") as file:
            file.write(MAGIC + struct.pack("<I", len(header)) + header)
            file.write(block.data)
        os.replace(temporary, path)
        self._remember(block.without_data(), len(block.data), path.stat().st_mtime)

    def read(self, key: bytes) -> Block | None:
        """The block with its data, or None when its file is gone or fails its checksum (then it is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        offset = 8 + struct.unpack_from("<I", data, 4)[0]
        payload = data[offset:]
        if len(payload) != entry.num_bytes or checksum(payload) != entry.meta.checksum:
            return None
        return replace(entry.meta, data=payload)

    def drop(self, key: bytes) -> Block | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.num_bytes -= entry.num_bytes
        self.path(key).unlink(missing_ok=True)
        return entry.meta

    def keys(self) -> Iterator[bytes]:
        return iter(self._entries)

    def scan(self) -> list[Block]:
        """Rebuild the index from the files (headers only), oldest first; unreadable files are deleted."""
        found: list[tuple[float, Block, int]] = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            parsed = _read_header(path)
            if parsed is None:
                path.unlink(missing_ok=True)
                continue
            meta, num_bytes, mtime = parsed
            found.append((mtime, meta, num_bytes))
        for path in self.root.glob("*/*.tmp"):  # a write cut short by a crash
            path.unlink(missing_ok=True)
        found.sort(key=lambda item: (item[0], item[1].block_hash))
        for mtime, meta, num_bytes in found:
            self._remember(meta, num_bytes, mtime)
        return [meta for _, meta, _ in found]

    def _remember(self, meta: Block, num_bytes: int, mtime: float) -> None:
        self._entries[meta.block_hash] = _FileEntry(meta, num_bytes, mtime)
        self.num_bytes += num_bytes


def _read_header(path: Path) -> tuple[Block, int, float] | None:
    try:
        with path.open("rb") as file:
            start = file.read(8)
            if len(start) != 8 or start[:4] != MAGIC:
                return None
            header = file.read(struct.unpack_from("<I", start, 4)[0])
            stat = os.fstat(file.fileno())
        message = kvcache_pb2.Block.FromString(header)
        meta = codec.block_from_pb(message)
    except (OSError, ValueError, struct.error, DecodeError):
        return None
    num_bytes = stat.st_size - 8 - len(header)
    if meta.checksum is None or meta.block_hash.hex() + SUFFIX != path.name or meta.layout.block_problem():
        return None  # not ours, or a block format this version cannot size
    return meta, num_bytes, stat.st_mtime
