"""Erasure coding with zfec: exact fragments, and the block back from any k of k+m."""

from __future__ import annotations

import itertools
import os

import pytest

from mesh.erasure import Protection, decode, encode, fragment_bytes


def test_protection_parses_k_plus_m() -> None:
    assert Protection.parse("2+1") == Protection(2, 1) and Protection.parse("10+2").num_total == 12
    assert Protection.parse("1") == Protection(1, 0) and str(Protection(1, 2)) == "1+2"
    with pytest.raises(ValueError, match="expected k\\+m"):
        Protection.parse("two")
    with pytest.raises(ValueError, match="k must be >= 1"):
        Protection.parse("0+1")


def test_data_fragments_are_the_block_in_order_and_the_last_is_padded() -> None:
    data = bytes(range(7))
    fragments = encode(data, 2, 3)
    assert fragments[:2] == [bytes([0, 1, 2, 3]), bytes([4, 5, 6, 0])]
    assert len(fragments[2]) == fragment_bytes(7, 2) == 4
    assert encode(data, 1, 3) == [data] * 3  # k=1: replication
    assert encode(data, 1, 1) == [data]


@pytest.mark.parametrize("k, m", [(2, 1), (3, 2), (10, 2)])
def test_any_k_fragments_give_the_block_back(k: int, m: int) -> None:
    data = os.urandom(1000 * k + 3)
    fragments = encode(data, k, k + m)
    for kept in itertools.islice(itertools.combinations(range(k + m), k), 50):
        assert decode({i: fragments[i] for i in kept}, k, k + m, len(data)) == data
    with pytest.raises(ValueError, match=f"{k - 1} fragment\\(s\\), {k} needed"):
        decode({i: fragments[i] for i in range(k - 1)}, k, k + m, len(data))


def test_losing_any_one_fragment_of_2_plus_1_loses_nothing() -> None:
    data = os.urandom(4096)
    fragments = encode(data, 2, 3)
    for lost in range(3):
        assert decode({i: f for i, f in enumerate(fragments) if i != lost}, 2, 3, 4096) == data
