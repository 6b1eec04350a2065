"""Text <-> token ids and chat templates, over the `tokenizers` library.

Chat templates come from model files, which are untrusted input: they render in jinja2's immutable
sandbox, with the helpers Hugging Face templates expect (`raise_exception`, `tojson`, `strftime_now`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers


class ChatTemplateError(ValueError):
    """A chat that the model's template refuses or cannot render."""


def _token_text(value: Any) -> str | None:
    """Special tokens appear in tokenizer_config.json as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
    return env.from_string(source)


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer | None:
        """The tokenizer of an HF model directory, or None if it has no tokenizer.json."""
        if not (path / "tokenizer.json").is_file():
            return None
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a chat as the model was trained to see it (tokenize with add_special_tokens=False)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
