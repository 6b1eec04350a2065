"""Text <-> token ids and chat templates, over the `tokenizers` library.

Chat templates come from model files, which are untrusted input: they render in jinja2's immutable
sandbox, with the helpers Hugging Face templates expect (`raise_exception`, `tojson`, `strftime_now`).

Chats (`encode_chat`) get control tokens only where the template put them: the literal text of an added token
(`<｜end▁of▁sentence｜>`, `<｜User｜>`, `<|im_start|>`) in a client string (system, user and tool messages, tool
schemas; not assistant turns, which templates parse) is swapped for a random marker before rendering and
tokenized as plain text after, with a copy of the tokenizer that matches no added token. Tokenizing runs in
`encode_batch`, which releases the GIL, so a long prompt on a worker thread does not stop the event loop; and a
prompt whose bytes alone prove it cannot fit (`max_token_bytes`) is refused before it is tokenized.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import re
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

from engine_core import token_bound
from engine_core.token_bound import ByteCountBound


class ChatTemplateError(ValueError):
    """A chat that the model's template refuses or cannot render."""


class PromptTooLong(ValueError):
    """The prompt's bytes alone prove it has at least `min_num_tokens` tokens, over the limit asked for."""

    def __init__(self, num_bytes: int, min_num_tokens: int) -> None:
        super().__init__(f"the prompt is {num_bytes} bytes, so at least {min_num_tokens} tokens")
        self.num_bytes = num_bytes
        self.min_num_tokens = min_num_tokens


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


def trie_pattern(texts: Sequence[str]) -> re.Pattern[str]:
    """A regex matching any of `texts`, longest first, built as a trie: one pass over 8 MiB takes tens of
    milliseconds where a plain alternation of a vocabulary's ~800 added tokens takes seconds."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie) if texts else r"(?!)")


# What keeps "a token covers at most max_token_bytes of the input" true: nothing may drop input text or fuse it.
# NFC composes at most 3 code points into one (Hangul jamo: 9 bytes -> 3), so it divides the bytes by at most 3.
_KEEPING_STEPS = {"Sequence", "ByteLevel", "Metaspace", "Digits", "Prepend", "Split", "Punctuation"}
_SHRINK = {"NFC": 3}


def _shrink_factor(step: dict[str, Any] | None) -> int | None:
    """How many times fewer bytes a normalizer / pre-tokenizer step can leave (1: never fewer); None: unbounded."""
    if step is None:
        return 1
    kind = step.get("type")
    if kind == "Sequence":
        factor = 1
        for child in step.get("normalizers") or step.get("pretokenizers") or []:
            child_factor = _shrink_factor(child)
            if child_factor is None:
                return None
            factor *= child_factor
        return factor
    if kind in _SHRINK:
        return _SHRINK[kind]
    if kind == "Replace":
        pattern = step.get("pattern", {}).get("String")
        return 1 if pattern is not None and len(step.get("content", "").encode()) >= len(pattern.encode()) else None
    if kind in ("Split", "Punctuation") and step.get("behavior") == "Removed":
        return None
    return 1 if kind in _KEEPING_STEPS else None


def _only_splits(step: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer keeps every byte as it is (splits, byte-level spelling, an added prefix space)."""
    if step is None:
        return True
    if step.get("type") == "Sequence":
        return all(map(_only_splits, step.get("pretokenizers", [])))
    if step.get("type") in ("Split", "Punctuation"):
        return step.get("behavior") != "Removed"
    return step.get("type") in ("ByteLevel", "Digits")


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())  # isascii() is O(1) on CPython's ASCII strings


@dataclasses.dataclass
class _Literals:
    """One rendering's literal added-token texts found in client strings, swapped for markers (a random nonce,
    ASCII letters and digits: no template or JSON escaping touches them) until the rendered text is tokenized."""

    pattern: re.Pattern[str]
    first_chars: frozenset[str]  # every literal starts with one of these: a string without any needs no regex
    nonce: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))
    texts: list[str] = dataclasses.field(default_factory=list)

    def protect(self, value: Any) -> Any:
        """`value` with every literal in its strings (dict keys, lists, tuples, dataclass fields) marked."""
        if isinstance(value, str):
            if not any(char in value for char in self.first_chars):  # memchr-fast, where the regex steps
                return value
            return self.pattern.sub(self._mark, value)
        if isinstance(value, dict):
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, list) or type(value) is tuple:
            return type(value)(self.protect(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: self.protect(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
            return dataclasses.replace(value, **fields)
        return value

    def _mark(self, match: re.Match[str]) -> str:
        self.texts.append(match.group(0))
        return f"kvm{self.nonce}n{len(self.texts) - 1}x"

    def restore(self, text: str) -> str:
        if not self.texts:
            return text
        return re.sub(f"kvm{self.nonce}n([0-9]+)x", lambda m: self.texts[int(m.group(1))], text)


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
        # control tokens: every added token but whitespace runs (which some vocabularies add as plain words)
        added = backend.get_added_tokens_decoder()
        self._control_ids = {t.content: i for i, t in added.items() if t.content.strip()}
        self._control_pattern = trie_pattern(list(self._control_ids))
        self._control_first_chars = frozenset(text[0] for text in self._control_ids)

    def warm(self) -> None:
        """Build what encode_chat and the byte bound need now (about a second for a large vocabulary)."""
        _ = self._plain, self.max_token_bytes, self._byte_count_bound

    @functools.cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        """This tokenizer with its control tokens unmatched: their text becomes ordinary tokens."""
        spec = json.loads(self.backend.to_str())
        for token in spec.get("added_tokens", []):
            if token["content"] in self._control_ids:
                token["special"] = True
        plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
        plain.encode_special_tokens = True  # special tokens' text is not split out
        return plain

    @functools.cached_property
    def _spec(self) -> dict[str, Any]:
        """The tokenizer's definition (tokenizer.json), read-only."""
        spec: dict[str, Any] = json.loads(self.backend.to_str())
        return spec

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """At most how many bytes of input text one token stands for (every vocabulary piece's bytes, an unknown
        character's 4, and what the normalizer can compose), so a text of B bytes has at least
        ceil(B / max_token_bytes) tokens. None where the pipeline can drop or fuse text (no bound)."""
        spec = self._spec
        model = spec["model"]
        if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
            return None
        shrink = [_shrink_factor(spec.get("normalizer")), _shrink_factor(spec.get("pre_tokenizer"))]
        if None in shrink:
            return None
        chars = bytes_to_unicode()
        vocab = list(self.backend.get_vocab(with_added_tokens=True))
        is_byte_level = sum(all(c in chars for c in piece) for piece in vocab) >= 0.99 * len(vocab)

        def piece_bytes(piece: str) -> int:
            if is_byte_level and all(c in chars for c in piece):
                return len(piece)
            return len(piece.replace("\u2581", " ").encode())

        longest = max([4, *(piece_bytes(piece) for piece in vocab)])
        return longest * math.prod(f for f in shrink if f is not None)

    @functools.cached_property
    def _byte_count_bound(self) -> ByteCountBound | None:
        """The bound by byte counts (engine_core.token_bound), where tokens cover the text's bytes as they are:
        BPE over byte-level pre-tokens, nothing normalized, nothing else done before. Pieces with other characters
        than the byte-level alphabet can never match, so they don't count."""
        spec = self._spec
        normalizer, pre_tokenizer = spec.get("normalizer"), spec.get("pre_tokenizer")
        if spec["model"].get("type") != "BPE" or normalizer not in (None, {"type": "Sequence", "normalizers": []}):
            return None
        if not _only_splits(pre_tokenizer) or '"ByteLevel"' not in json.dumps(pre_tokenizer):
            return None
        chars = bytes_to_unicode()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        pieces = [bytes(chars[c] for c in piece) for piece in vocab if all(c in chars for c in piece)]
        pieces += [token.content.encode() for token in self.backend.get_added_tokens_decoder().values()]
        return ByteCountBound(pieces)

    def check_size(self, texts: Sequence[str], num_control_tokens: int, max_num_tokens: int) -> None:
        """PromptTooLong when `texts` (tokenized each on its own) plus the control tokens must reach
        max_num_tokens: first by their bytes / max_token_bytes, then, for texts long enough to possibly not fit and
        to cost more to tokenize than the bound takes (token_bound.MIN_BYTES), by their byte counts."""
        num_bytes = sum(map(_utf8_len, texts))
        per_token = self.max_token_bytes
        if per_token is None:
            return
        min_num_tokens = num_control_tokens + -(-num_bytes // per_token)
        bound = self._byte_count_bound
        worth_it = num_bytes >= max(max_num_tokens - num_control_tokens, token_bound.MIN_BYTES)
        if min_num_tokens < max_num_tokens and bound is not None and worth_it:
            enough = max_num_tokens - num_control_tokens
            min_num_tokens = max(min_num_tokens, num_control_tokens + bound.min_num_tokens(texts, enough))
        if min_num_tokens >= max_num_tokens:
            raise PromptTooLong(num_bytes, min_num_tokens)

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

    def encode(self, text: str, add_special_tokens: bool = True, max_num_tokens: int | None = None) -> list[int]:
        """The text's ids (added tokens in it matched: a raw prompt is the model's own text). PromptTooLong first
        if its bytes prove it has max_num_tokens or more."""
        if max_num_tokens is not None:
            self.check_size([text], 0, max_num_tokens)
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids  # GIL released
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

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        prepare: Callable[[list[dict[str, Any]], Callable[[Any], Any]], list[dict[str, Any]]] | None = None,
        max_num_tokens: int | None = None,
    ) -> list[int]:
        """The chat rendered for generation and tokenized, control tokens only where the template wrote them (or
        an assistant turn holds them: see below). `prepare(messages, protect)` may rewrite the (protected)
        messages before rendering and writes control tokens of its own (tool-call markers); it passes any client
        text it adds through `protect`.
        PromptTooLong before tokenizing when the rendered text's bytes prove it has max_num_tokens or more."""
        literals = _Literals(self._control_pattern, self._control_first_chars)
        # An assistant turn is left as sent: templates parse it (reasoning cut at `</think>`), and the client
        # writes it whole anyway; its text says nothing a forged turn could not.
        protected = [dict(m) if m.get("role") == "assistant" else literals.protect(m) for m in messages]
        if prepare is not None:
            protected = prepare(protected, literals.protect)
        text = self.apply_chat_template(protected, add_generation_prompt=True)
        pieces: list[str | int] = []  # plain text (client literals restored) and the template's control token ids
        start = 0
        for match in self._control_pattern.finditer(text):
            pieces += [literals.restore(text[start : match.start()]), self._control_ids[match.group(0)]]
            start = match.end()
        pieces.append(literals.restore(text[start:]))
        texts = [piece for piece in pieces if isinstance(piece, str) and piece]
        if max_num_tokens is not None:
            num_control = sum(isinstance(piece, int) for piece in pieces)
            self.check_size(texts, num_control, max_num_tokens)
        encoded = iter(self._plain.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            elif piece:
                ids += next(encoded).ids
        return ids
