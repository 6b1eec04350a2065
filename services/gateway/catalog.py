"""The models the gateway can serve: their tokenizers, chat templates and context lengths.

Loaded once at start from the model files (a GGUF's metadata or an HF directory's tokenizer files; no
weights), then read-only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_core import model_store
from engine_core.config import ConfigError
from engine_core.loader.checkpoint import open_checkpoint
from engine_core.tokenizer import ChatTemplateError, Tokenizer
from engine_core.vision import image_token_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.tool_calls import ToolSyntax, syntax_for


@functools.cache
def bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that spells each byte, inverted (character -> byte)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {byte: chr(byte) for byte in kept}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    context_len: int  # prompt + generated tokens must fit (the model's max_position_embeddings)
    image_token_id: int | None = None  # the image placeholder token of a model that takes images (engine_core.vision)

    @functools.cached_property
    def tool_syntax(self) -> ToolSyntax:
        """How this model writes tool calls (its vocabulary tells: DeepSeek's tool tokens, else Hermes)."""
        return syntax_for(self.tokenizer.backend.get_vocab(with_added_tokens=True))

    @functools.cached_property
    def _byte_decoder(self) -> dict[str, int] | None:
        """GPT-2's byte-level alphabet -> bytes, when this vocabulary is spelled in it (None otherwise)."""
        chars = bytes_to_unicode()
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=False)
        spelled = sum(all(c in chars for c in piece) for piece in vocab)
        return chars if spelled >= 0.99 * len(vocab) else None

    def token_bytes(self, token_id: int) -> bytes:
        """A token's exact bytes (a byte-level piece may hold part of a UTF-8 character)."""
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is None:
            return b""
        decoder = self._byte_decoder
        if decoder is not None and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The chat as the model was trained to see it, ready for generation, as token ids."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise invalid("messages", str(exc)) from None
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt, with the BOS token when the model's tokenizer adds one."""
        return self.tokenizer.encode(text, add_special_tokens=True)

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise invalid(param, f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")

    def check_lengths(
        self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str, max_tokens_param: str
    ) -> None:
        """The prompt leaves room for at least one token, and for max_tokens when it is set."""
        if num_prompt_tokens == 0:
            raise invalid(prompt_param, "the prompt is empty")
        if num_prompt_tokens >= self.context_len:
            raise GatewayError(
                ErrorKind.CONTEXT_LENGTH,
                f"this model's context is {self.context_len} tokens; the prompt has {num_prompt_tokens}",
                prompt_param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.context_len:
            raise GatewayError(
                ErrorKind.CONTEXT_LENGTH,
                f"this model's context is {self.context_len} tokens; the prompt has "
                f"{num_prompt_tokens} and {max_tokens_param} asks for {max_tokens} more",
                max_tokens_param,
            )


def load_model(name: str) -> ServedModel:
    """Open `name` (a known model name or a path) for its tokenizer; fails naming the model."""
    checkpoint = open_checkpoint(model_store.resolve(name))
    if checkpoint.tokenizer is None:
        raise ConfigError(f"model {name!r} has no tokenizer: the gateway needs one to serve it")
    return ServedModel(
        name, checkpoint.tokenizer, checkpoint.config.max_position_embeddings, image_token_id(checkpoint.config.raw)
    )


class ModelCatalog:
    def __init__(self, models: Iterable[ServedModel]) -> None:
        self._models = {model.name: model for model in models}  # read-only after construction

    @classmethod
    def load(cls, names: Iterable[str]) -> ModelCatalog:
        return cls(load_model(name) for name in names)

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def require(self, name: str) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            raise GatewayError(ErrorKind.MODEL_NOT_FOUND, f"the model {name!r} does not exist", "model")
        return model
