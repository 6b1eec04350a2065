"""Incremental detokenization with the real SmolLM2 and DeepSeek-V3 tokenizers: no partial UTF-8 ever
emitted; stop strings matched across token boundaries and never emitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core import model_store
from engine_core.loader.checkpoint import open_checkpoint
from engine_core.tokenizer import Tokenizer
from services.gateway.detokenizer import Detokenizer, IncrementalDecoder, StopMatcher

SMOLLM2_ASSISTANT_PROMPT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path: Path) -> Tokenizer:
    tokenizer = open_checkpoint(smollm2_gguf_path).tokenizer
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def deepseek() -> Tokenizer:
    tokenizer = open_checkpoint(model_store.ensure("deepseek-tiny")).tokenizer
    assert tokenizer is not None
    return tokenizer


def pieces(decoder: IncrementalDecoder, token_ids: list[int]) -> list[str]:
    return [decoder.push(token_id) for token_id in token_ids] + [decoder.flush()]


def test_smollm2_cjk_split_across_tokens(smollm2: Tokenizer) -> None:
    token_ids = smollm2.encode("Say 日本語 now", add_special_tokens=False)
    assert token_ids == [36218, 17097, 241, 115, 40993, 179, 120, 248, 1209]  # 日 and 語 are 3 byte tokens each
    out = pieces(IncrementalDecoder(smollm2, SMOLLM2_ASSISTANT_PROMPT), token_ids)
    assert out == ["Say", "", "", " 日", "本", "", "", "語", " now", ""]


def test_smollm2_accents_and_symbols(smollm2: Tokenizer) -> None:
    token_ids = smollm2.encode("The café costs 5€.", add_special_tokens=False)
    out = pieces(IncrementalDecoder(smollm2, SMOLLM2_ASSISTANT_PROMPT), token_ids)
    assert out == ["The", " café", " costs", " ", "5", "€", ".", ""]


def test_deepseek_emoji_split_across_tokens(deepseek: Tokenizer) -> None:
    token_ids = deepseek.encode("🦜 ok", add_special_tokens=False)
    assert token_ids == [3574, 102, 253, 9109]
    assert pieces(IncrementalDecoder(deepseek), token_ids) == ["", "", "🦜", " ok", ""]


def test_no_piece_is_ever_partial_utf8(smollm2: Tokenizer) -> None:
    text = "Ünïcödé 🙂🦜 — 中文字符 and ascii ✓"
    token_ids = smollm2.encode(text, add_special_tokens=False)
    out = pieces(IncrementalDecoder(smollm2, SMOLLM2_ASSISTANT_PROMPT), token_ids)
    assert all("\ufffd" not in piece for piece in out)
    assert "".join(out) == text


def test_special_tokens_are_not_text(smollm2: Tokenizer) -> None:
    decoder = IncrementalDecoder(smollm2, SMOLLM2_ASSISTANT_PROMPT)
    assert decoder.push(19556) == "Hello"
    assert decoder.push(2) == ""  # <|im_end|>, the EOS
    assert decoder.flush() == ""


def test_bytes_that_never_form_a_character_come_out_at_the_end(deepseek: Tokenizer) -> None:
    decoder = IncrementalDecoder(deepseek)
    assert [decoder.push(3574), decoder.push(102)] == ["", ""]  # 3 of the parrot's 4 bytes
    tail = decoder.flush()
    assert tail and set(tail) == {"\ufffd"}


def run(detokenizer: Detokenizer, token_ids: list[int]) -> tuple[list[str], int]:
    """(emitted pieces, number of tokens accepted before the stop)."""
    out = []
    for count, token_id in enumerate(token_ids, start=1):
        out.append(detokenizer.push(token_id))
        if detokenizer.is_stopped:
            return out, count
    out.append(detokenizer.finish())
    return out, len(token_ids)


def test_stop_string_across_token_boundary_is_not_emitted(smollm2: Tokenizer) -> None:
    token_ids = smollm2.encode("Hello world. Bye now", add_special_tokens=False)
    assert [smollm2.decode([t]) for t in token_ids] == ["Hello", " world", ".", " By", "e", " now"]
    out, num_tokens = run(Detokenizer(smollm2, SMOLLM2_ASSISTANT_PROMPT, ["Bye"]), token_ids)
    assert out == ["Hello", " world", ".", " ", ""]  # "By" was held back until "e" completed the stop
    assert num_tokens == 5
    assert "".join(out) == "Hello world. "


def test_earliest_stop_string_wins(deepseek: Tokenizer) -> None:
    token_ids = deepseek.encode("Hello world. Bye now", add_special_tokens=False)
    out, num_tokens = run(Detokenizer(deepseek, [], ["now", "world", "xyz-long-stop"]), token_ids)
    assert "".join(out) == "Hello "
    assert num_tokens == 2


def test_stop_string_inside_a_multibyte_run(smollm2: Tokenizer) -> None:
    token_ids = smollm2.encode("Say 日本語 now", add_special_tokens=False)
    out, num_tokens = run(Detokenizer(smollm2, SMOLLM2_ASSISTANT_PROMPT, ["本語"]), token_ids)
    assert "".join(out) == "Say 日"
    assert num_tokens == 8  # the last byte of 語 completes the stop string


def test_a_stop_prefix_at_the_end_is_emitted(smollm2: Tokenizer) -> None:
    token_ids = smollm2.encode("Hello world", add_special_tokens=False)
    out, _ = run(Detokenizer(smollm2, SMOLLM2_ASSISTANT_PROMPT, ["world peace"]), token_ids)
    assert "".join(out) == "Hello world"


def test_no_stop_strings_emits_at_once(smollm2: Tokenizer) -> None:
    token_ids = smollm2.encode("Hello world", add_special_tokens=False)
    out, _ = run(Detokenizer(smollm2, SMOLLM2_ASSISTANT_PROMPT, []), token_ids)
    assert out == ["Hello", " world", ""]


def test_stop_matcher_holds_back_only_what_could_start_a_stop() -> None:
    matcher = StopMatcher(["abc", "x"])
    assert matcher.push("12a") == ("12", False)  # "a" might begin "abc"
    assert matcher.push("b") == ("", False)
    assert matcher.push("d") == ("abd", False)
    assert matcher.push("ab") == ("", False)
    assert matcher.push("cZ") == ("", True)
    matcher = StopMatcher(["abc"])
    assert matcher.push("zzab") == ("zz", False)
    assert matcher.flush() == "ab"
    assert StopMatcher(["", ""]).push("abc") == ("abc", False)
