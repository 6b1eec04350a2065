"""A lower bound on a text's number of tokens from its bytes alone, tighter than bytes / longest piece.

Where a tokenizer's tokens cover the text's bytes as they are (byte-level BPE, nothing normalized), the count
vectors of the tokens' bytes add up to the text's: c = sum_t n_t, with c[v] the text's count of byte v and n_t that
of token t's piece. So for any weights w >= 0, w . c = sum_t w . n_t <= T * max_p w . n_p over every piece p of the
vocabulary, and the text has at least T >= w . c / max_p w . n_p tokens. Weights that follow the text (w = c) bound
a text of words; a piece of 128 spaces would then dominate "describe describe ...", so the byte that weighs most
in the heaviest piece is dropped from w and the bound taken again, a few times, keeping the best.
Bytes added to the text (a prefix space) only raise sum_t n_t. A byte without a piece of its own is dropped by BPE
(or becomes an unknown token), so it weighs nothing. A step that changes bytes (a normalizer) voids the bound.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MAX_ROUNDS = 3  # each a pass over the vocabulary's bytes (0.86 M for DeepSeek-V3's): 10-35 ms; the second round
# gives the most (1 MiB of "describe ": 10,013, then 72,818; 8 rounds 77,672)
MIN_BYTES = 64 * 1024  # below this, tokenizing (1-5 us a byte here) costs about what the rounds do: just tokenize


class ByteCountBound:
    def __init__(self, pieces: Iterable[bytes]) -> None:
        kept = sorted(piece for piece in pieces if piece)  # sorted: ties between pieces go the same way each run
        self._flat = np.frombuffer(b"".join(kept), dtype=np.uint8)  # (total,): every piece's bytes in a row
        self._starts = np.cumsum([0, *map(len, kept[:-1])], dtype=np.int64)  # (num_pieces,)
        self._weighable = np.zeros(256, dtype=np.int64)  # (256,): 1 for a byte that is a piece of its own
        self._weighable[[piece[0] for piece in kept if len(piece) == 1]] = 1

    def min_num_tokens(self, texts: Iterable[str], enough: int | None = None) -> int:
        """At least how many tokens `texts`, each tokenized on its own, come to in all; it stops trying tighter
        weights once it has shown `enough`."""
        counts = np.zeros(256, dtype=np.int64)
        for text in texts:
            counts += np.bincount(np.frombuffer(text.encode(), dtype=np.uint8), minlength=256)
        weights = counts * self._weighable
        best = 0
        for _ in range(MAX_ROUNDS):
            if not weights.any() or (enough is not None and best >= enough):
                break
            per_piece = np.add.reduceat(weights[self._flat], self._starts)  # (num_pieces,): w . n_p
            heaviest = int(per_piece.argmax())
            best = max(best, -(-int(weights @ counts) // int(per_piece[heaviest])))
            start = int(self._starts[heaviest])
            piece = self._flat[start : start + self._piece_len(heaviest)]
            weights[piece[weights[piece].argmax()]] = 0  # the byte that weighs most in the heaviest piece
        return best

    def _piece_len(self, index: int) -> int:
        end = self._starts[index + 1] if index + 1 < len(self._starts) else len(self._flat)
        return int(end - self._starts[index])
