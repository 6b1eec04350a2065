"""The models the gateway can serve: their tokenizers, chat templates and context lengths.

Loaded once at start from the model files (a GGUF's metadata or an HF directory's tokenizer files; no
weights), then read-only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine_core import model_store
from engine_core.config import ConfigError
from engine_core.loader.checkpoint import open_checkpoint
from engine_core.tokenizer import ChatTemplateError, PromptTooLong, Tokenizer, bytes_to_unicode
from engine_core.vision import image_token_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.tokenizer_threads import TokenizerThreads
from services.gateway.tool_calls import Tool, ToolSyntax, syntax_for

IMAGE_MARKER = "<|kvmesh:image|>"  # one per image part in the flattened text, until the model is known
T = TypeVar("T")
_TOKENIZER_THREADS = TokenizerThreads()  # tokenizing and template rendering: never on the event loop


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the tokenizer threads. A cancelled caller stops waiting; a running call ends on its own."""
    return await _TOKENIZER_THREADS.run(fn, *args)


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    context_len: int  # prompt + generated tokens must fit (the model's max_position_embeddings)
    image_token_id: int | None = None  # the image placeholder token of a model that takes images (engine_core.vision)

    def __post_init__(self) -> None:
        self.tokenizer.warm()  # at load, not in the first request: the byte bound and the plain-text tokenizer

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

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[Tool] = ()) -> list[int]:
        """The chat as the model was trained to see it, ready for generation, as token ids: the tools described in
        this model's format, each image part's marker as the model's image token, and control tokens only where
        the template or the tool format put them (engine_core.tokenizer.encode_chat). Blocks the calling thread
        for as long as tokenizing takes: the gateway calls it off the event loop. A prompt whose bytes prove it
        cannot fit the context is refused (CONTEXT_LENGTH) before it is tokenized."""

        def prepare(protected: list[dict[str, Any]], protect: Any) -> list[dict[str, Any]]:
            if tools:
                protected = self.tool_syntax.render_messages(protected, protect(tuple(tools)))
            if self.image_token_id is None:
                return protected
            token = self.tokenizer.backend.id_to_token(self.image_token_id)
            return [
                {**m, "content": m["content"].replace(IMAGE_MARKER, token)} if isinstance(m.get("content"), str) else m
                for m in protected
            ]

        try:
            return self.tokenizer.encode_chat(messages, prepare, max_num_tokens=self.context_len)
        except ChatTemplateError as exc:
            raise invalid("messages", str(exc)) from None
        except PromptTooLong as exc:
            raise self._too_long(exc, "messages") from None

    def encode_prompt(self, text: str, param: str = "prompt") -> list[int]:
        """A raw prompt, with the BOS token when the model's tokenizer adds one. Its added-token text stays control
        tokens: a raw prompt is the model's own format, written by the client on purpose."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=True, max_num_tokens=self.context_len)
        except PromptTooLong as exc:
            raise self._too_long(exc, param) from None

    def _too_long(self, exc: PromptTooLong, param: str) -> GatewayError:
        return GatewayError(
            ErrorKind.CONTEXT_LENGTH,
            f"this model's context is {self.context_len} tokens; the prompt is {exc.num_bytes} bytes, so at least "
            f"{exc.min_num_tokens} tokens (refused before tokenizing)",
            param,
        )

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
