"""`deepseek-v4-tiny`: the DeepSeek-V4 architecture at a CPU-friendly size, written as an ordinary HF directory.

Like `deepseek-tiny` (engine_core.tiny): random weights from a fixed seed (the same bytes on every machine), the
DeepSeek tokenizer and chat template, and every part of the real architecture runs. Its four layers hold every
layer type: a window-only layer, two CSA layers (overlapping compressor of ratio 4, the lightning indexer keeping
the top 16 entries), an HCA layer (ratio 16), the first two MoE layers hash-routed (token id -> experts), the
other two scored (sqrtsoftplus + correction bias); 4 hyper-connection streams; a sliding window of 32. The
ratios and the window are smaller than V4-Flash's (4/128, 128) so that prompts of a few dozen tokens already close
compressed windows, and the HCA ratio equals the mesh's default block size (16).

Tensor names are DeepSeek's own (`layers.1.attn.compressor.ape`, `layers.2.ffn.experts.5.w1.weight`...), the names
transformers' DeepseekV4ForCausalLM also loads. Floating-point tensors are stored in bfloat16 (either model reads
them into its own dtype), the hash table as int64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine_core.tiny import write_deepseek_tokenizer, write_model_dir

DEEPSEEK_V4_TINY_VERSION = 1
SEED = 0

DEEPSEEK_V4_TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 32,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 16384,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "partial_rotary_factor": 0.25,  # 16 of each head's 64 dims rotated
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "kvmesh_tiny_version": DEEPSEEK_V4_TINY_VERSION,
}


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint under its DeepSeek name, with its shape."""
    hidden, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    mixes = (2 + n) * n  # hyper-connections: pre (n), post (n) and comb (n x n) weights
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (vocab, hidden),
        "head.weight": (vocab, hidden),
        "norm.weight": (hidden,),
        "hc_head_fn": (n, n * hidden),
        "hc_head_base": (n,),
        "hc_head_scale": (1,),
    }
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}"
        shapes |= {f"{p}.attn_norm.weight": (hidden,), f"{p}.ffn_norm.weight": (hidden,)}
        for sub in ("attn", "ffn"):
            shapes |= {
                f"{p}.hc_{sub}_fn": (mixes, n * hidden),
                f"{p}.hc_{sub}_base": (mixes,),
                f"{p}.hc_{sub}_scale": (3,),
            }
        shapes |= _attention_shapes(cfg, f"{p}.attn", kind)
        shapes |= _moe_shapes(cfg, f"{p}.ffn", cfg["mlp_layer_types"][i] == "hash_moe")
    return shapes


def _attention_shapes(cfg: dict[str, Any], p: str, kind: str) -> dict[str, tuple[int, ...]]:
    hidden, heads, d, q_lora = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    groups, o_lora = cfg["o_groups"], cfg["o_lora_rank"]
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}.wq_a.weight": (q_lora, hidden),
        f"{p}.q_norm.weight": (q_lora,),
        f"{p}.wq_b.weight": (heads * d, q_lora),
        f"{p}.wkv.weight": (d, hidden),
        f"{p}.norm.weight": (d,),
        f"{p}.wo_a.weight": (groups * o_lora, heads * d // groups),
        f"{p}.wo_b.weight": (hidden, groups * o_lora),
        f"{p}.attn_sink": (heads,),
    }
    if kind == "sliding_attention":
        return shapes
    ratio = cfg["compress_rates"][kind]
    is_csa = kind == "compressed_sparse_attention"
    shapes |= _compressor_shapes(f"{p}.compressor", hidden, d, ratio, 2 if is_csa else 1)
    if is_csa:
        index_heads, index_dim = cfg["index_n_heads"], cfg["index_head_dim"]
        shapes |= _compressor_shapes(f"{p}.indexer.compressor", hidden, index_dim, ratio, 2)
        shapes |= {
            f"{p}.indexer.wq_b.weight": (index_heads * index_dim, q_lora),
            f"{p}.indexer.weights_proj.weight": (index_heads, hidden),
        }
    return shapes


def _compressor_shapes(p: str, hidden: int, width: int, ratio: int, series: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{p}.wkv.weight": (series * width, hidden),
        f"{p}.wgate.weight": (series * width, hidden),
        f"{p}.ape": (ratio, series * width),
        f"{p}.norm.weight": (width,),
    }


def _moe_shapes(cfg: dict[str, Any], p: str, is_hash: bool) -> dict[str, tuple[int, ...]]:
    hidden, width, experts = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    shapes: dict[str, tuple[int, ...]] = {f"{p}.gate.weight": (experts, hidden)}
    if is_hash:
        shapes[f"{p}.gate.tid2eid"] = (cfg["vocab_size"], cfg["num_experts_per_tok"])
    else:
        shapes[f"{p}.gate.bias"] = (experts,)
    for prefix in [f"{p}.shared_experts", *(f"{p}.experts.{e}" for e in range(experts))]:
        shapes |= {
            f"{prefix}.w1.weight": (width, hidden),
            f"{prefix}.w3.weight": (width, hidden),
            f"{prefix}.w2.weight": (hidden, width),
        }
    return shapes


def random_weights(cfg: dict[str, Any], seed: int = SEED) -> dict[str, torch.Tensor]:
    """Norms and hyper-connection scales at one; a small random correction bias; sinks, position biases and
    hyper-connection biases N(0, 0.5) (transformers starts them at zero, which would leave them untested); each
    token id's distinct experts drawn at random; everything else N(0, 0.02). All floats rounded to bfloat16."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(_tensor_shapes(cfg).items()):
        if name.endswith("tid2eid"):
            scores = torch.rand(shape[0], cfg["n_routed_experts"], generator=generator)
            weights[name] = scores.argsort(dim=-1)[:, : shape[1]].contiguous()  # int64
            continue
        if name.endswith(("norm.weight", "_scale")):
            tensor = torch.ones(shape)
        elif name.endswith("gate.bias"):
            tensor = torch.rand(shape, generator=generator) * 0.1
        elif name.endswith(("attn_sink", ".ape", "_base")):
            tensor = torch.randn(shape, generator=generator) * 0.5
        else:
            tensor = torch.randn(shape, generator=generator) * 0.02
        weights[name] = tensor.to(torch.bfloat16)
    return weights


def write_deepseek_v4_tiny(dest: Path, seed: int = SEED) -> Path:
    """Write the model directory at `dest` (atomically: a half-written directory is never seen)."""

    def fill(work: Path) -> None:
        weights = random_weights(DEEPSEEK_V4_TINY_CONFIG, seed)
        save_file(weights, str(work / "model.safetensors"), metadata={"format": "pt"})
        write_deepseek_tokenizer(work, [])
        (work / "config.json").write_text(json.dumps(DEEPSEEK_V4_TINY_CONFIG, indent=2))

    return write_model_dir(dest, fill)
