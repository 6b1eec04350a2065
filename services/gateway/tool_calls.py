"""Tool calls in a model's own output format: how tools and past calls enter the prompt, the grammar a call
is generated under, and the streaming parser that turns output text back into calls.

Two formats (`ToolSyntax`), chosen by the model's vocabulary:

    deepseek  DeepSeek-V3's tokens, as its chat template writes past calls:
              <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
              (more calls joined by "\\n") <｜tool▁calls▁end｜>
    hermes    for chat templates without tool support (SmolLM2's is plain ChatML): the Hermes/Qwen format that
              SmolLM2's own function-calling data uses, one block per call:
              <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>   (calls joined by "\\n")
              past calls are appended to the assistant's content; tool results go in a `tool` turn wrapped in
              <tool_response>...</tool_response>

Whenever tools may be called (tool_choice auto, required or a named tool), the output follows a grammar
(an xgrammar structural tag): with `auto` free text until the call marker, then a call; with `required` a
call at once; with a named tool that tool. ARGS is the tool's schema as compact JSON, so a call always
parses and validates, and a tool without parameters gets exactly `{}`.

The parser is the same for streamed and whole responses and its output does not depend on how the text was
split, so streamed argument deltas joined are exactly the whole response's arguments.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr  # at start: imported by the first request with tools, it held the event loop 1.5-2.7 s

from engine_core.structured_output import StructuredOutput
from services.gateway.errors import invalid
from services.gateway.schema_support import Unsupported, check_schema, checked_grammar

TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    name: str = ""  # the tool, when mode is named


# frozen, so one instance serves as every dataclass's default
NO_TOOLS = ToolChoice("none")
AUTO_TOOLS = ToolChoice("auto")


def parse_tool(name: Any, description: Any, parameters: Any, param: str) -> Tool:
    """One tool definition, its schema checked for what the grammar can enforce."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(f"{param}.name", "a tool name must be 1-64 characters of letters, digits, '_', '.' or '-'")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{param}.description", "a tool description must be a string")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise invalid(f"{param}.parameters", "tool parameters must be a JSON Schema object")
    try:
        check_schema(parameters)
    except Unsupported as exc:
        raise invalid(f"{param}.parameters", str(exc)) from None
    return Tool(name, description or "", parameters)


def check_tools(tools: Sequence[Tool], choice: ToolChoice, param: str = "tools") -> None:
    if len(tools) > MAX_TOOLS:
        raise invalid(param, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    if len({tool.name for tool in tools}) != len(tools):
        raise invalid(param, "tool names must be unique")
    if choice.mode in ("required", "named") and not tools:
        raise invalid("tool_choice", f"tool_choice '{choice.mode}' needs tools")
    if choice.mode == "named" and choice.name not in {tool.name for tool in tools}:
        raise invalid("tool_choice", f"tool_choice names {choice.name!r}, which is not among the tools")


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolSyntax:
    name: str
    calls_begin: str  # before the first call ("" when each call stands alone)
    calls_end: str
    call_begin: str  # a call's opening marker
    call_prefix: str  # after it, before the name
    name_suffix: str  # between the name and the arguments
    args_suffix: str  # after the arguments, before the closing marker
    call_end: str  # a call's closing marker
    separator: str  # between calls
    template_renders_calls: bool  # the chat template writes assistant tool_calls and tool turns itself
    marker_tokens: tuple[str, ...] = ()  # markers that are single tokens: the grammar asks for the token itself

    @property
    def call_opening(self) -> str:
        return self.call_begin + self.call_prefix

    @property
    def call_closing(self) -> str:
        return self.args_suffix + self.call_end

    @property
    def trigger(self) -> str:
        """The text that starts tool calls."""
        return self.calls_begin or self.call_opening

    def call_text(self, name: str, arguments: str) -> str:
        return f"{self.call_opening}{name}{self.name_suffix}{arguments}{self.call_closing}"

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        return self.calls_begin + self.separator.join(self.call_text(n, a) for n, a in calls) + self.calls_end

    def system_prompt(self, tools: Sequence[Tool]) -> str:
        listing = "\n".join(
            json.dumps(
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
            )
            for t in tools
        )
        example = self.calls_text([("<function-name>", "<arguments-json-object>")])
        return (
            "You may call one or more functions to assist with the user query. The functions are described "
            f"within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\nTo call functions, answer "
            f"with the calls in exactly this format:\n{example}"
        )

    def render_messages(self, messages: Sequence[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
        """The messages as the chat template should see them: the tools described in the system message,
        past calls and results in this format when the template cannot write them."""
        out = [dict(m) for m in messages]
        if tools:
            prompt = self.system_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
            else:
                out.insert(0, {"role": "system", "content": prompt})
        if self.template_renders_calls:
            return out
        for message in out:
            calls = message.pop("tool_calls", None)
            if calls:
                text = self.calls_text([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
                message["content"] = f"{message['content']}{text}"
            if message["role"] == "tool":
                message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
                message.pop("tool_call_id", None)
        return out

    def grammar(
        self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutput:
        """The structural tag the output follows: tool_choice auto, required or named (not none).
        `token_id` gives a marker's token id in the model's vocabulary."""
        assert choice.mode != "none"
        chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        bodies = [
            {
                "type": "sequence",
                "elements": [
                    *self._literal(f"{self.call_prefix}{t.name}{self.name_suffix}", token_id),
                    {"type": "grammar", "grammar": _compact_json_grammar(t.parameters)},
                    *self._literal(self.args_suffix, token_id),
                ],
            }
            for t in chosen
        ]
        call = {
            "type": "tag",
            "begin": self._marker(self.call_begin, token_id),
            "content": bodies[0] if len(bodies) == 1 else {"type": "or", "elements": bodies},
            "end": self._marker(self.call_end, token_id),
        }
        calls: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": [call],
            "separator": self.separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        block = {
            "type": "tag",
            "begin": self._marker(self.calls_begin, token_id),
            "content": calls,
            "end": self._marker(self.calls_end, token_id),
        }
        fmt: dict[str, Any] = block if self.calls_begin else calls
        if choice.mode == "auto" and self.calls_begin in self.marker_tokens:
            fmt = {
                "type": "token_triggered_tags",
                "trigger_tokens": [token_id(self.calls_begin)],
                "tags": [block],
                "stop_after_first": True,
            }
        elif choice.mode == "auto":
            fmt = {
                "type": "triggered_tags",
                "triggers": [self.calls_begin or self.call_begin],
                "tags": [block] if self.calls_begin else [call],
                "stop_after_first": not parallel,
            }
        spec = json.dumps({"type": "structural_tag", "format": fmt})
        return checked_grammar("structural_tag", spec, "tools")

    def _marker(self, text: str, token_id: Callable[[str], int | None]) -> Any:
        """A tag's begin or end: the marker's token when it is one (a model writes it as one token; the text
        spelled out of smaller tokens would be a different output), else the text."""
        if text in self.marker_tokens:
            return {"type": "token", "token": token_id(text)}
        return text

    def _literal(self, text: str, token_id: Callable[[str], int | None]) -> list[dict[str, Any]]:
        if not self.marker_tokens:
            return [{"type": "const_string", "value": text}] if text else []
        parts = re.split("(" + "|".join(map(re.escape, self.marker_tokens)) + ")", text)
        return [
            self._marker(p, token_id) if p in self.marker_tokens else {"type": "const_string", "value": p}
            for p in parts
            if p
        ]


def _compact_json_grammar(schema: dict[str, Any]) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


_DEEPSEEK_MARKERS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
DEEPSEEK = ToolSyntax(
    name="deepseek",
    calls_begin="<｜tool▁calls▁begin｜>",
    calls_end="<｜tool▁calls▁end｜>",
    call_begin="<｜tool▁call▁begin｜>",
    call_prefix="function<｜tool▁sep｜>",
    name_suffix="\n```json\n",
    args_suffix="\n```",
    call_end="<｜tool▁call▁end｜>",
    separator="\n",
    template_renders_calls=True,
    marker_tokens=_DEEPSEEK_MARKERS,
)
HERMES = ToolSyntax(
    name="hermes",
    calls_begin="",
    calls_end="",
    call_begin="<tool_call>",
    call_prefix='\n{"name": "',
    name_suffix='", "arguments": ',
    args_suffix="}\n",
    call_end="</tool_call>",
    separator="\n",
    template_renders_calls=False,
)


def syntax_for(vocab: dict[str, int]) -> ToolSyntax:
    """DeepSeek's format when its tool tokens are in the vocabulary, else Hermes."""
    if all(marker in vocab for marker in _DEEPSEEK_MARKERS):
        return DEEPSEEK
    return HERMES


# ---- parsing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedText:
    text: str


@dataclass(frozen=True)
class ParsedCallStart:
    call_index: int
    name: str


@dataclass(frozen=True)
class ParsedArgs:
    call_index: int
    delta: str


@dataclass(frozen=True)
class ParsedCallEnd:
    call_index: int
    arguments: str  # the whole arguments text


Parsed = ParsedText | ParsedCallStart | ParsedArgs | ParsedCallEnd


def _held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker` (to hold back until it is known)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


@dataclass
class ToolCallParser:
    """Output text -> content and tool calls, incrementally. Only `push` and `finish` write its state."""

    syntax: ToolSyntax
    _state: str = "text"  # text | block (between calls inside calls_begin..calls_end) | name | args
    _buffer: str = ""
    _args: list[str] = field(default_factory=list)
    _strip_leading: bool = False  # after a call: drop the whitespace that separates calls from later text
    num_calls: int = 0

    def push(self, text: str) -> list[Parsed]:
        self._buffer += text
        out: list[Parsed] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Parsed]:
        """The end of the output: whatever was held back (a truncated call keeps its partial arguments)."""
        out: list[Parsed] = []
        rest, self._buffer = self._buffer, ""
        if self._state == "args" and rest:
            self._args.append(rest)
            out.append(ParsedArgs(self.num_calls - 1, rest))
        elif self._state == "text":
            self._text(rest, out)
        return out

    def _step(self, out: list[Parsed]) -> bool:
        """Consume what can be decided from the buffer; True if the state changed (look again)."""
        syntax, buffer = self.syntax, self._buffer
        if self._state == "text":
            at = buffer.find(syntax.trigger)
            if at < 0:
                keep = _held(buffer, syntax.trigger)
                self._text(buffer[: len(buffer) - keep], out)
                self._buffer = buffer[len(buffer) - keep :]
                return False
            self._text(buffer[:at], out)
            self._buffer = buffer[at + len(syntax.trigger) :]
            self._state = "block" if syntax.calls_begin else "name"
            return True
        if self._state == "block":
            for marker, state in (
                (syntax.call_opening, "name"),
                (syntax.separator, "block"),
                (syntax.calls_end, "text"),
            ):
                if buffer.startswith(marker):
                    self._buffer, self._state = buffer[len(marker) :], state
                    self._strip_leading = state == "text"
                    return True
            if any(m.startswith(buffer) for m in (syntax.call_opening, syntax.separator, syntax.calls_end)):
                return False  # not decided yet
            self._state = "text"  # not the format (cannot happen under the grammar): the rest is text
            return True
        if self._state == "name":
            at = buffer.find(syntax.name_suffix)
            if at < 0:
                return False
            out.append(ParsedCallStart(self.num_calls, buffer[:at]))
            self.num_calls += 1
            self._args = []
            self._buffer, self._state = buffer[at + len(syntax.name_suffix) :], "args"
            return True
        at = buffer.find(syntax.call_closing)  # args
        end = at if at >= 0 else len(buffer) - _held(buffer, syntax.call_closing)
        if end > 0:
            self._args.append(buffer[:end])
            out.append(ParsedArgs(self.num_calls - 1, buffer[:end]))
        if at < 0:
            self._buffer = buffer[end:]
            return False
        out.append(ParsedCallEnd(self.num_calls - 1, "".join(self._args)))
        self._buffer = buffer[at + len(syntax.call_closing) :]
        self._state = "block" if syntax.calls_begin else "text"
        self._strip_leading = not syntax.calls_begin
        return True

    def _text(self, text: str, out: list[Parsed]) -> None:
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return
            self._strip_leading = False
        if text:
            out.append(ParsedText(text))
