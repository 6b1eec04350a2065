"""Where a key lives among KV store nodes: rendezvous (highest random weight) hashing.

Every node gets a score for the key from SHA-256 over (node, key); the highest score owns it. Any process that
knows the same nodes picks the same owner (no Python `hash()`, which is salted per process), and when a node
joins or leaves only the keys it wins or held move: the others keep their owner.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _score(key: bytes, node: str) -> bytes:
    encoded = node.encode()
    # the length prefix keeps (node, key) pairs unambiguous: ("ab", "c...") never hashes like ("a", "bc...")
    return hashlib.sha256(len(encoded).to_bytes(4, "little") + encoded + key).digest()


def rank_nodes(key: bytes, nodes: Sequence[str]) -> list[str]:
    """The nodes in order of preference for `key`: the owner first, then where a replica would go."""
    return sorted(set(nodes), key=lambda node: (_score(key, node), node), reverse=True)


def rendezvous_owner(key: bytes, nodes: Sequence[str]) -> str:
    """The node that owns `key`. Raises ValueError when there is no node."""
    if not nodes:
        raise ValueError("no nodes to place a key on")
    return max(nodes, key=lambda node: (_score(key, node), node))
