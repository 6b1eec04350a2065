"""Erasure coding of KV blocks (zfec, a Reed-Solomon codec from PyPI): k data fragments plus m parity fragments,
any k of which give the block back. k=1 is replication (every fragment is a full copy); 1+0 is no protection.

The code is systematic: fragment i < k is the block's bytes [i*s, (i+1)*s) (the last one zero-padded), so reading
the k data fragments needs no decoding at all, only a join; parity is decoded only when a data fragment is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import zfec


@dataclass(frozen=True)
class Protection:
    num_data: int = 1  # k
    num_parity: int = 0  # m

    def __post_init__(self) -> None:
        if self.num_data < 1 or self.num_parity < 0 or self.num_data + self.num_parity > 256:
            raise ValueError(f"protection {self}: k must be >= 1, m >= 0, k + m <= 256")

    @property
    def num_total(self) -> int:
        return self.num_data + self.num_parity

    @classmethod
    def parse(cls, text: str) -> Protection:
        """ "2+1" (erasure coding), "1+2" (three copies), "1+0" (none)."""
        data, plus, parity = text.strip().partition("+")
        try:
            num_data, num_parity = int(data), int(parity) if plus else 0
        except ValueError:
            raise ValueError(f"protection {text!r}: expected k+m, e.g. 2+1") from None
        return cls(num_data, num_parity)

    def __str__(self) -> str:
        return f"{self.num_data}+{self.num_parity}"


def fragment_bytes(num_block_bytes: int, num_data: int) -> int:
    return -(-num_block_bytes // num_data)


def encode(data: bytes, num_data: int, num_total: int) -> list[bytes]:
    """The block's `num_total` fragments, data fragments first."""
    if num_total == 1:
        return [data]
    size = fragment_bytes(len(data), num_data)
    padded = data + bytes(size * num_data - len(data))
    pieces = [padded[i * size : (i + 1) * size] for i in range(num_data)]
    if num_data == 1:
        return pieces * num_total
    return list(zfec.Encoder(num_data, num_total).encode(pieces))


def decode(fragments: Mapping[int, bytes], num_data: int, num_total: int, num_block_bytes: int) -> bytes:
    """The block from any `num_data` of its fragments (by index). Raises ValueError with fewer."""
    if len(fragments) < num_data:
        raise ValueError(f"{len(fragments)} fragment(s), {num_data} needed")
    if num_data == 1:
        return next(iter(fragments.values()))[:num_block_bytes]
    if all(i in fragments for i in range(num_data)):  # the data fragments: a join, no decoding
        return b"".join(fragments[i] for i in range(num_data))[:num_block_bytes]
    indices = sorted(fragments)[:num_data]
    pieces = zfec.Decoder(num_data, num_total).decode([fragments[i] for i in indices], indices)
    return b"".join(pieces)[:num_block_bytes]
