"""The models the gateway can serve: their tokenizers, chat templates and context lengths.

Loaded once at start from the model files (a GGUF's metadata or an HF directory's tokenizer files; no
weights), then read-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_core import model_store
from engine_core.config import ConfigError
from engine_core.loader.checkpoint import open_checkpoint
from engine_core.tokenizer import ChatTemplateError, Tokenizer
from services.gateway.errors import ErrorKind, GatewayError, invalid


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    context_len: int  # prompt + generated tokens must fit (the model's max_position_embeddings)

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

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str) -> None:
        """The prompt leaves room for at least one token, and for max_tokens when it is set."""
        if num_prompt_tokens == 0:
            raise invalid(prompt_param, "the prompt is empty")
        if num_prompt_tokens >= self.context_len:
            raise GatewayError(ErrorKind.CONTEXT_LENGTH,
                               f"this model's context is {self.context_len} tokens; the prompt has "
                               f"{num_prompt_tokens}", prompt_param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.context_len:
            raise GatewayError(ErrorKind.CONTEXT_LENGTH,
                               f"this model's context is {self.context_len} tokens; the prompt has "
                               f"{num_prompt_tokens} and {max_tokens_param} asks for {max_tokens} more",
                               max_tokens_param)


def load_model(name: str) -> ServedModel:
    """Open `name` (a known model name or a path) for its tokenizer; fails naming the model."""
    checkpoint = open_checkpoint(model_store.resolve(name))
    if checkpoint.tokenizer is None:
        raise ConfigError(f"model {name!r} has no tokenizer: the gateway needs one to serve it")
    return ServedModel(name, checkpoint.tokenizer, checkpoint.config.max_position_embeddings)


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
