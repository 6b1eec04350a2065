"""The GGUF loader against transformers' own GGUF loading, on the real SmolLM2-135M-Instruct Q4_1 file."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine_core.loader.gguf import GGUFCheckpoint, check_tensor_type, unpermute_rotary_rows


@pytest.fixture(scope="module")
def checkpoint(smollm2_gguf_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(smollm2_gguf_path)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: GGUFCheckpoint) -> Tokenizer:
    return checkpoint.tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="module")
def hf_state_dict(smollm2_gguf_path: Path, checkpoint: GGUFCheckpoint) -> Iterator[dict[str, torch.Tensor]]:
    """transformers' GGUF weights. `from_pretrained(gguf_file=...)` needs `accelerate`, which the test
    extras lack, so this calls the function it delegates to. The weightless model only lists the HF
    names; the head counts that undo the rotary permutation come from transformers' own reading."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**checkpoint.config))
    parsed = load_gguf_checkpoint(str(smollm2_gguf_path), return_tensors=True, model_to_load=model)
    yield parsed["tensors"]


def test_config_matches_smollm2(checkpoint: GGUFCheckpoint) -> None:
    assert checkpoint.config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,  # stored as float32 9.999999747e-06; read back as the decimal it was
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def test_tokenizer_metadata(checkpoint: GGUFCheckpoint) -> None:
    assert checkpoint.bos_token == "<|im_start|>"
    assert checkpoint.eos_token == "<|im_end|>"
    assert checkpoint.add_bos_token is False
    template = checkpoint.chat_template
    assert template is not None and template.startswith("{% for message in messages %}")
    assert "<|im_start|>assistant\n" in template


def test_tensors_equal_transformers(checkpoint: GGUFCheckpoint, hf_state_dict: dict[str, torch.Tensor]) -> None:
    # Both dequantize with gguf.quants.dequantize in float32, so equality is exact; q/k being equal too
    # shows the rotary permutation is undone the way transformers undoes it.
    names = []
    for name, weight in checkpoint.tensors():
        expected = hf_state_dict[name]
        assert weight.dtype == torch.float32 and weight.shape == expected.shape, name
        assert torch.equal(weight, expected), name
        names.append(name)
    assert len(names) == len(set(names)) == len(hf_state_dict) == 272  # 30 layers * 9 + embed + norm
    assert "lm_head.weight" not in names  # tied: the engine reuses model.embed_tokens.weight


def test_unpermute_inverts_llama_cpp_permute() -> None:
    # llama.cpp's converter: rows (H, 2, D/2) -> (H, D/2, 2). One head of 4 rows: HF [0, 1, 2, 3] is
    # stored [0, 2, 1, 3] (each row of the first half next to its partner in the second).
    stored = torch.tensor([0.0, 2.0, 1.0, 3.0])
    assert unpermute_rotary_rows(stored, num_heads=1).tolist() == [0.0, 1.0, 2.0, 3.0]
    hf = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(3 * 8, 5)  # 3 heads of 8 rows, 5 inputs
    permuted = hf.reshape(3, 2, 4, 5).transpose(1, 2).reshape(24, 5)
    assert not torch.equal(permuted, hf)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads=3), hf)


# Strings on which our tokenizer and transformers' GGUF tokenizer must give the same ids.
SAME_AS_TRANSFORMERS = [
    "Hello, world!",
    "12345",
    "3.14159 and 2024-01-01 at 9am",
    "def f(x):\n    return x**2  # square\n",
    "héllo wörld 日本語 🤖 naïve café",
    "a   b\t\tc\n\n\nd",
    "  leading and trailing  ",
    "I'm sure you'll've",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]


@pytest.mark.parametrize("text", SAME_AS_TRANSFORMERS)
def test_tokenizer_matches_transformers(tokenizer: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


# Whitespace before a digit: SmolLM2's own tokenizer.json, and llama.cpp's "smollm" pre-tokenizer, split
# digits off first, so the spaces stand alone and merge ("ĠĠ"). transformers' GGUF tokenizer has no entry
# for "smollm" and uses the plain GPT-2 split, which glues one space to the digit and gives
# ["a", "Ġ", "Ġ", "1", "2"]. We match the model's own tokenizer: that is what it was trained on.
# (No merge in this vocabulary contains a digit, so "12345" alone is five tokens either way.)
DIGITS_AFTER_WHITESPACE = {
    "a  12": ["a", "ĠĠ", "1", "2"],
    "x =  42\n  7": ["x", "Ġ=", "ĠĠ", "4", "2", "ĊĠĠ", "7"],
    "\n\n3": ["ĊĊ", "3"],
}


@pytest.mark.parametrize("text", DIGITS_AFTER_WHITESPACE)
def test_tokenizer_splits_digits_like_smollm2(tokenizer: Tokenizer, text: str) -> None:
    encoding = tokenizer.encode(text)
    assert encoding.tokens == DIGITS_AFTER_WHITESPACE[text]
    assert tokenizer.decode(encoding.ids) == text


def test_special_tokens_stay_whole(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    assert tokenizer.decode([1, 4093, 198, 6004, 2], skip_special_tokens=True) == "user\nhi"
    assert tokenizer.get_vocab_size() == 49152


# -- small files written here -----------------------------------------------------------------------


def _tiny_llama_writer(path: Path, arch: str = "llama") -> gguf.GGUFWriter:
    """Metadata of a one-layer llama: hidden 32, 4 heads of 8, 2 KV heads."""
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(16)
    return writer


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def test_tiny_file_types_and_layout(tmp_path: Path) -> None:
    # Integers in [-8, 7] with a -8 in every 32-block are exact in F16, BF16 and Q4_0 (scale 1).
    rng = np.random.default_rng(0)
    q, k, up = (rng.integers(-8, 8, size=shape).astype(np.float32) for shape in ((32, 32), (16, 32), (64, 32)))
    for weight in (q, k, up):
        weight[:, 0] = -8
    writer = _tiny_llama_writer(tmp_path / "tiny.gguf")
    writer.add_tensor("blk.0.attn_q.weight", _llama_cpp_permute(q, 4).astype(np.float16))
    bf16 = gguf.quants.quantize(_llama_cpp_permute(k, 2), GGMLQuantizationType.BF16)
    writer.add_tensor("blk.0.attn_k.weight", bf16, raw_dtype=GGMLQuantizationType.BF16)
    q4 = gguf.quants.quantize(up, GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.ffn_up.weight", q4, raw_dtype=GGMLQuantizationType.Q4_0)
    _close(writer)

    checkpoint = GGUFCheckpoint(tmp_path / "tiny.gguf")
    weights = dict(checkpoint.tensors())
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], torch.from_numpy(up))
    assert checkpoint.config["head_dim"] == 8 and checkpoint.config["rope_theta"] == 10000.0


def test_unsupported_tensor_type_raises(tmp_path: Path) -> None:
    writer = _tiny_llama_writer(tmp_path / "q5k.gguf")
    # Q5_K: 256 values in 176 bytes; the bytes need not be meaningful, the type is refused at open.
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 176), np.uint8), raw_dtype=GGMLQuantizationType.Q5_K)
    _close(writer)
    message = "tensor blk.0.attn_q.weight has quantization type Q5_K; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GGUFCheckpoint(tmp_path / "q5k.gguf")
    with pytest.raises(ValueError, match="tensor x has quantization type Q4_K;"):
        check_tensor_type("x", GGMLQuantizationType.Q4_K)


def test_non_llama_architecture_raises(tmp_path: Path) -> None:
    _close(_tiny_llama_writer(tmp_path / "qwen2.gguf", arch="qwen2"))
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported: only llama is supported from GGUF"):
        GGUFCheckpoint(tmp_path / "qwen2.gguf")


def test_unknown_tensor_name_raises(tmp_path: Path) -> None:
    writer = _tiny_llama_writer(tmp_path / "moe.gguf")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 4, 32), np.float32))
    _close(writer)
    with pytest.raises(
        ValueError, match=re.escape("tensor blk.0.ffn_gate_exps.weight has no Hugging Face Llama counterpart")
    ):
        GGUFCheckpoint(tmp_path / "moe.gguf")


def test_sentencepiece_tokenizer_raises(tmp_path: Path) -> None:
    writer = _tiny_llama_writer(tmp_path / "spm.gguf")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    _close(writer)
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported; supported: gpt2"):
        GGUFCheckpoint(tmp_path / "spm.gguf").tokenizer()


def test_tiny_gpt2_tokenizer_adds_bos_and_eos_when_asked(tmp_path: Path) -> None:
    writer = _tiny_llama_writer(tmp_path / "bos.gguf")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab", "<think>"])
    writer.add_token_types([3, 3, 1, 1, 1, 1, 1, 4])
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    _close(writer)
    tokenizer = GGUFCheckpoint(tmp_path / "bos.gguf").tokenizer()
    assert tokenizer.encode("ab ab<think>").ids == [0, 4, 6, 7, 1]
    assert tokenizer.encode("ab ab<think>", add_special_tokens=False).ids == [4, 6, 7]
    assert tokenizer.encode("ab", "b").ids == [0, 4, 1, 0, 3, 1]
    # user-defined tokens stay whole but are text: only control tokens are skipped when decoding
    assert tokenizer.decode([0, 4, 6, 7, 1]) == "ab ab<think>"
