"""DeepSeek-V4's configuration: current and legacy field names, unsupported fields, KV sizes per layer type."""

from __future__ import annotations

import pytest

from engine_core.config import ConfigError, ModelConfig
from engine_core.models.deepseek_v4.shapes import V4_FLASH
from engine_core.models.deepseek_v4.state import bytes_per_sequence, bytes_per_token

V4_TEST_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=8,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,  # an exact tie of indexer scores (every head relu 0) flips the reference with its length
    index_head_dim=16,
    index_topk=3,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_sinkhorn_iters=4,  # 20 in V4-Flash; fewer keeps the test cheap and changes no code path
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    partial_rotary_factor=0.25,  # 8 of 32 dims rotated
    initializer_range=0.1,
)


def legacy_config() -> dict:
    """The same architecture in the field names older V4 checkpoints ship."""
    raw = {k: v for k, v in V4_TEST_CONFIG.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types")}
    raw.pop("partial_rotary_factor")
    raw["rope_scaling"] = raw.pop("rope_parameters")
    return {
        **raw,
        "model_type": "deepseek_v4",
        "compress_ratios": [0, 4, 128, 4],
        "compress_rate_hca": 8,
        "num_hash_layers": 2,
        "qk_rope_head_dim": 8,
    }


def test_legacy_field_names_read_as_the_new_ones():
    current = ModelConfig.from_hf({**V4_TEST_CONFIG, "model_type": "deepseek_v4"})
    legacy = ModelConfig.from_hf(legacy_config())
    assert legacy.v4 == current.v4
    assert current.v4 is not None
    assert current.v4.attention_types == ("window", "csa", "hca", "csa")
    assert current.v4.is_hash_moe == (True, True, False, False)
    assert (current.v4.rope_head_dim, current.v4.csa_ratio, current.v4.hca_ratio) == (8, 4, 8)
    assert current.v4.compress_rope_scaling is not None
    assert current.v4.compress_rope_scaling["attention_factor"] == 1.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"compress_ratios": [0, 4, 64, 4]}, "compress_ratios"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"o_groups": 3}, "o_groups"),
        ({"mlp_layer_types": ["moe"] * 3}, "mlp_layer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ],
)
def test_unsupported_fields_fail_naming_them(change, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf({**legacy_config(), **change})


def test_kv_bytes_of_v4_flash_against_v3():
    """bf16: 6,880 bytes per token against V3's 70,272 (61 layers of a 512 + 64 latent), plus ~5.6 MB of
    windows per sequence."""
    v4 = ModelConfig.from_hf(V4_FLASH).v4
    assert v4 is not None
    assert v4.attention_types.count("csa") == 21 and v4.attention_types.count("hca") == 20
    per_token = bytes_per_token(v4, 2)
    assert per_token == {"window": 0, "csa": 320, "hca": 8}
    assert sum(per_token[kind] for kind in v4.attention_types) == 6880
    assert 61 * (512 + 64) * 2 == 70272
    per_sequence = bytes_per_sequence(v4, 2)
    assert per_sequence["window"] == 127 * 512 * 2
    assert sum(per_sequence["window"] for _ in v4.attention_types) == 5_592_064
    assert per_sequence["hca"] - per_sequence["window"] == 127 * 512 * 2 * 2  # an open 128-token window
