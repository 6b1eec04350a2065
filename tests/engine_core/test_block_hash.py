import subprocess
import sys

from engine_core.kv_cache.block_hash import hash_block, hash_token_blocks, root_hash


def test_keys_chain_parent_tokens_and_extra_keys():
    root = root_hash("smollm2-135m")
    first = hash_block(root, [1, 2, 3, 4])
    assert len(first) == 32
    assert hash_block(root, [1, 2, 3, 4]) == first
    assert hash_block(root, [1, 2, 3, 5]) != first
    assert hash_block(first, [1, 2, 3, 4]) != first  # same tokens, other prefix
    assert hash_block(root, [1, 2, 3, 4], ["img:abc"]) != first
    assert hash_block(root, [1, 2, 3, 4], ["img:abc"]) != hash_block(root, [1, 2, 3, 4], [b"img:abc"])


def test_model_and_tenant_salt_separate_roots():
    assert root_hash("a") != root_hash("b")
    assert root_hash("a", "tenant-1") != root_hash("a", "tenant-2")
    assert root_hash("a", None) == root_hash("a", "")


def test_golden_value_pins_the_wire_format():
    # Keys cross processes and machines; a change of encoding must be deliberate (and versioned).
    assert root_hash("m").hex()[:16] == "a85270e52367769d"
    assert hash_block(root_hash("m"), [1, 2, 3]).hex()[:16] == "67406b7d28fe12ca"


def test_hash_token_blocks_covers_full_blocks_and_extends_known_ones():
    root = root_hash("m")
    tokens = list(range(11))
    full = hash_token_blocks(root, tokens, 4)
    assert len(full) == 2
    assert full[1] == hash_block(hash_block(root, tokens[:4]), tokens[4:8])
    assert hash_token_blocks(root, [*tokens, 11], 4, full[:1]) == [*full, hash_block(full[1], [8, 9, 10, 11])]


def test_keys_are_equal_across_processes_with_different_hash_seeds():
    code = "from engine_core.kv_cache.block_hash import *; print(hash_block(root_hash('m', 's'), [5, 6]).hex())"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {hash_block(root_hash("m", "s"), [5, 6]).hex() + "\n"}
