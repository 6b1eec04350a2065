"""A request's output text, a piece at a time: incremental detokenization that never emits part of a UTF-8
character, then stop strings matched across token boundaries and never emitted.

Incremental decoding (the scheme vLLM uses with fast tokenizers): decode a short window of tokens twice,
without and with the newest ones, and emit the difference, unless it ends in U+FFFD (the newest token
stopped inside a multi-byte character: wait for the rest). The window starts a few prompt tokens back so
tokenizers that strip a leading space when decoding a lone piece see the context they need.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens the first window starts with
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])  # window tokens, then generated ones
        self._prefix_offset = 0  # the window: _token_ids[_prefix_offset:]
        self._read_offset = len(self._token_ids)  # tokens before this are emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._token_ids[start:end], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """The new text this token completes ("" while a character is still incomplete)."""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: whatever is held back (bytes that never formed a character come out as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Holds back the longest tail of the text that could still begin a stop string (shorter than it)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stop for stop in stops if stop)
        self._max_held = max((len(stop) for stop in self.stops), default=1) - 1
        self._pending = ""  # text received and not yet emitted; never contains a whole stop string
        self.matched: str | None = None  # the stop string found (the earliest; the first listed on a tie)

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found: nothing after it may be emitted)."""
        if not self.stops:
            return text, False
        self._pending += text
        starts = [(start, stop) for stop in self.stops if (start := self._pending.find(stop)) >= 0]
        if starts:
            start, self.matched = min(starts, key=lambda found: found[0])
            emitted, self._pending = self._pending[:start], ""
            return emitted, True
        num_safe = len(self._pending) - self._num_to_hold()
        emitted, self._pending = self._pending[:num_safe], self._pending[num_safe:]
        return emitted, False

    def _num_to_hold(self) -> int:
        for length in range(min(len(self._pending), self._max_held), 0, -1):
            tail = self._pending[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0

    def flush(self) -> str:
        emitted, self._pending = self._pending, ""
        return emitted


class Detokenizer:
    """One request's output: feed token ids, get the text to send. After a stop string, `is_stopped`."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str]) -> None:
        self._decoder = IncrementalDecoder(tokenizer, prompt_token_ids)
        self._stops = StopMatcher(stop)
        self.is_stopped = False

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stops.matched

    def push(self, token_id: int) -> str:
        assert not self.is_stopped, "no tokens after a stop string"
        text, self.is_stopped = self._stops.push(self._decoder.push(token_id))
        return text

    def finish(self) -> str:
        """The held-back text once generation ended without a stop string."""
        if self.is_stopped:
            return ""
        text, self.is_stopped = self._stops.push(self._decoder.flush())
        return text if self.is_stopped else text + self._stops.flush()
