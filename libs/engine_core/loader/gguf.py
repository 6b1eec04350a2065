"""A llama.cpp GGUF file read as a Hugging Face Llama checkpoint.

A GGUF file holds the weights under llama.cpp's names and layout and the tokenizer as metadata; the engine
speaks Hugging Face's. This module owns that translation, all read from the one file:
  config       an HF `config.json`-style dict, from the `llama.*` metadata
  tensors()    every weight under its HF name, dequantized to float32, one tensor at a time
  tokenizer()  a `tokenizers.Tokenizer` rebuilt from the `tokenizer.ggml.*` metadata

Dequantization is the `gguf` package's (the llama.cpp project's own Python reference). Only the llama
architecture and the tensor types in `SUPPORTED_TYPES` are read; anything else fails when the file is opened.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from os import PathLike
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

SUPPORTED_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)

# `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# (GGUF name inside a block, HF name inside a layer, whether a bias may accompany the weight)
_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm", False),
    "ffn_norm": ("post_attention_layernorm", False),
    "attn_q": ("self_attn.q_proj", True),
    "attn_k": ("self_attn.k_proj", True),
    "attn_v": ("self_attn.v_proj", True),
    "attn_output": ("self_attn.o_proj", True),
    "ffn_gate": ("mlp.gate_proj", False),
    "ffn_up": ("mlp.up_proj", False),
    "ffn_down": ("mlp.down_proj", False),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF `llama.rope.scaling.*` key -> HF `rope_scaling` key; keys not listed keep their GGUF name.
_ROPE_SCALING_NAMES = {
    "type": "rope_type",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
}


def check_tensor_type(name: str, tensor_type: GGMLQuantizationType) -> None:
    """Raise ValueError unless `tensor_type` is one this loader dequantizes."""
    if tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"tensor {name} has quantization type {tensor_type.name}; supported: {supported}")


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor; ValueError for a tensor HF Llama has no place for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is not None and match.group(2) in _LAYER_NAMES:
        layer, (hf_name, may_have_bias) = match.group(1), _LAYER_NAMES[match.group(2)]
        if match.group(3) == "weight" or may_have_bias:
            return f"model.layers.{layer}.{hf_name}.{match.group(3)}"
    if gguf_name == "rope_freqs.weight":
        # Llama 3.1-style rope scaling is stored only as these precomputed frequencies, which an HF
        # config cannot express; loading without them would silently change every rotary angle.
        raise ValueError("tensor rope_freqs.weight (llama3 rope scaling) is not supported from GGUF")
    raise ValueError(f"tensor {gguf_name} has no Hugging Face Llama counterpart")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k projection rows (weight or bias) for its rotary layout.

    HF Llama rotates the two halves of each head against each other (`rotate_half`); llama.cpp rotates
    adjacent pairs. Its converter therefore moves HF row h*D + i*D/2 + j (head h, half i, j < D/2) to
    row h*D + 2*j + i. Viewing the stored rows as (H, D/2, 2) and swapping the last two axes puts them back.
    """
    head_dim = weight.shape[0] // num_heads
    assert head_dim * num_heads == weight.shape[0] and head_dim % 2 == 0, (weight.shape, num_heads)
    rest = weight.shape[1:]
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)  # (H, D/2, 2, in)
    return pairs.transpose(1, 2).reshape(weight.shape)  # (H, 2, D/2, in) -> (H*D, in)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as float32 in HF layout (GGUF lists dims innermost first, so reversed)."""
    check_tensor_type(tensor.name, tensor.tensor_type)
    values = dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a read-only view of the memory-mapped file: copy it so no tensor outlives the
    # mapping or aliases it; every other type is already a fresh array and is used as it is.
    values = np.require(values, dtype=np.float32, requirements=["C_CONTIGUOUS", "WRITEABLE"])
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(values).reshape(shape)


def _float32_value(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # SmolLM's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) cut every digit apart
    # before the GPT-2 split: no token joins a digit to anything, and whitespace before a digit stays
    # one piece ("a  1" -> "a", "ĠĠ", "1") instead of lending the digit a space.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()])


# `tokenizer.ggml.pre` -> the pre-tokenizer the vocabulary's merges were learned with.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _gpt2_pre_tokenizer,
    "smollm": _smollm_pre_tokenizer,
}


class GGUFCheckpoint:
    """A GGUF file opened read-only (memory-mapped); config and tokenizer are rebuilt on each call."""

    def __init__(self, path: str | PathLike[str]) -> None:
        self.path = path
        self._reader = GGUFReader(path, "r")
        architecture = self._value("general.architecture")
        if architecture != "llama":
            raise ValueError(f"GGUF architecture {architecture!r} is not supported: only llama is supported from GGUF")
        # Fail at open rather than halfway through loading the weights.
        for tensor in self._reader.tensors:
            check_tensor_type(tensor.name, tensor.tensor_type)
            hf_tensor_name(tensor.name)

    # -- metadata ----------------------------------------------------------------------------------
    def _value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _required(self, key: str) -> Any:
        value = self._value(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks metadata key {key}")
        return value

    def _token(self, id_key: str) -> str | None:
        token_id = self._value(id_key)
        return None if token_id is None else self._token_text(int(token_id))

    def _token_text(self, token_id: int) -> str:
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF file {self.path} lacks metadata key tokenizer.ggml.tokens")
        return tokens.contents(token_id)  # one entry, without decoding the whole vocabulary

    def _has_tensor(self, gguf_name: str) -> bool:
        return any(t.name == gguf_name for t in self._reader.tensors)

    @property
    def chat_template(self) -> str | None:
        return self._value("tokenizer.chat_template")

    @property
    def bos_token(self) -> str | None:
        return self._token("tokenizer.ggml.bos_token_id")

    @property
    def eos_token(self) -> str | None:
        return self._token("tokenizer.ggml.eos_token_id")

    @property
    def add_bos_token(self) -> bool:
        return bool(self._value("tokenizer.ggml.add_bos_token", False))

    # -- config ------------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        """An HF `config.json`-style dict for `LlamaForCausalLM` (a new dict on every call)."""
        hidden_size = int(self._required("llama.embedding_length"))
        num_heads = int(self._required("llama.attention.head_count"))
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": hidden_size,
            "intermediate_size": int(self._required("llama.feed_forward_length")),
            "num_hidden_layers": int(self._required("llama.block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._value("llama.attention.head_count_kv", num_heads)),
            "head_dim": self._head_dim(hidden_size, num_heads),
            "rms_norm_eps": _float32_value(self._value("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": _float32_value(self._value("llama.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._required("llama.context_length")),
            "vocab_size": self._vocab_size(),
            "tie_word_embeddings": not self._has_tensor("output.weight"),
            "attention_bias": self._has_tensor("blk.0.attn_q.bias"),
            "bos_token_id": self._value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._value("tokenizer.ggml.eos_token_id"),
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        return config

    def _head_dim(self, hidden_size: int, num_heads: int) -> int:
        head_dim = int(self._value("llama.attention.key_length", hidden_size // num_heads))
        rotary_dims = int(self._value("llama.rope.dimension_count", head_dim))
        if rotary_dims != head_dim:
            # HF Llama rotates the whole head; a partial-rotary file would load but compute wrong.
            raise ValueError(f"GGUF llama.rope.dimension_count {rotary_dims} != head_dim {head_dim}")
        return head_dim

    def _vocab_size(self) -> int:
        vocab_size = self._value("llama.vocab_size")
        if vocab_size is None:
            # Older files omit it; the token list has one entry per embedding row.
            vocab_size = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        return int(vocab_size)

    def _rope_scaling(self) -> dict[str, Any] | None:
        prefix = "llama.rope.scaling."
        scaling: dict[str, Any] = {}
        for key in self._reader.fields:
            if key.startswith(prefix):
                value = self._value(key)
                name = key[len(prefix) :]
                scaling[_ROPE_SCALING_NAMES.get(name, name)] = (
                    _float32_value(value) if isinstance(value, float) else value
                )
        if scaling.get("rope_type", "none") == "none":
            return None
        return scaling

    # -- weights -----------------------------------------------------------------------------------
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF shape) for every weight, dequantized one at a time."""
        config = self.config
        heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        for tensor in self._reader.tensors:
            weight = _dequantize(tensor)
            layer_name = _LAYER_NAME.fullmatch(tensor.name)
            if layer_name is not None and layer_name.group(2) in heads_of:
                weight = unpermute_rotary_rows(weight, heads_of[layer_name.group(2)])
            yield hf_tensor_name(tensor.name), weight

    # -- tokenizer ---------------------------------------------------------------------------------
    def tokenizer(self) -> Tokenizer:
        """The byte-level BPE tokenizer the metadata describes, special tokens never split."""
        model = self._value("tokenizer.ggml.model")
        if model != "gpt2":
            # SentencePiece ("llama") vocabularies would need their merges rebuilt from scores; that is
            # not checked against a real file yet, so it is refused rather than guessed.
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported; supported: gpt2 (byte-level BPE)")
        pre = self._value("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(_PRE_TOKENIZERS)}")
        tokens: list[str] = self._required("tokenizer.ggml.tokens")
        merges = [tuple(merge.split(" ", 1)) for merge in self._required("tokenizer.ggml.merges")]
        bpe = models.BPE(
            vocab={token: token_id for token_id, token in enumerate(tokens)},
            merges=merges,
            ignore_merges=False,
        )
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = self._post_processor()
        self._add_special_tokens(tokenizer, tokens)
        return tokenizer

    def _add_special_tokens(self, tokenizer: Tokenizer, tokens: list[str]) -> None:
        # Control tokens (and the named bos/eos/unk/pad) are special: skipped by decode(skip_special_tokens).
        # User-defined ones (e.g. "<think>") must also stay whole, but are text the model reads and writes.
        token_types: list[int] = self._value("tokenizer.ggml.token_type", [])
        named_ids = {self._value(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
        special = [i for i, kind in enumerate(token_types) if kind == _TOKEN_CONTROL]
        special += sorted(i for i in named_ids if i is not None and i not in special)
        user_defined = [i for i, kind in enumerate(token_types) if kind == _TOKEN_USER_DEFINED]
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])

    def _post_processor(self) -> processors.PostProcessor:
        byte_level = processors.ByteLevel(trim_offsets=True)
        bos = self._special_token("bos") if self.add_bos_token else None
        eos = self._special_token("eos") if self._value("tokenizer.ggml.add_eos_token", False) else None
        if bos is None and eos is None:
            return byte_level

        def wrap(sequence: str, type_id: int) -> str:
            edges = [f"{bos[0]}:{type_id}"] if bos else []
            return " ".join(edges + [f"${sequence}:{type_id}"] + ([f"{eos[0]}:{type_id}"] if eos else []))

        # The bos/eos the metadata asks for around every encoded text, where HF's tokenizer.json puts them.
        template = processors.TemplateProcessing(
            single=wrap("A", 0),
            pair=f"{wrap('A', 0)} {wrap('B', 1)}",
            special_tokens=sorted({token for token in (bos, eos) if token is not None}),
        )
        return processors.Sequence([byte_level, template])

    def _special_token(self, name: str) -> tuple[str, int]:
        token_id = int(self._required(f"tokenizer.ggml.{name}_token_id"))
        return self._token_text(token_id), token_id
