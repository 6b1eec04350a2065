"""Workload files -> sessions: one request, or a conversation whose turns go one after another.

Four kinds, told apart by each file's first line (JSON Lines) or a `synthetic:` spec:

    Mooncake trace   {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}
    request file     {"api": "chat"|"responses"|"messages", "body": {...}, "expected_text": "...", "checks": [...]}
    conversations    {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]} (ShareGPT) or
                     {"messages": [{"role": ..., "content": ...}]}
    synthetic        synthetic:requests=20,input=256,output=32,spread=0.25,prefix=0.5

A malformed line names its file and line: skipped with a warning, or the whole load fails under `strict`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.eval.prompts import WORDS, synthetic_prompt, trace_prompt

APIS = ("chat", "responses", "messages")
CHECK_KINDS = ("tool_call", "json_schema", "contains", "regex")
DEFAULT_CONVERSATION_OUTPUT_TOKENS = 64


class WorkloadError(ValueError):
    """A workload that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Check:
    kind: str  # one of CHECK_KINDS
    value: str = ""  # tool_call: the tool's name ("" any); contains: the text; regex: the pattern


@dataclass(frozen=True)
class Turn:
    api: str
    body: dict[str, Any]  # the API's request body; a conversation's turn holds only its own new message
    expected_text: str | None = None  # what a greedy run must answer, exactly
    checks: tuple[Check, ...] = ()


@dataclass(frozen=True)
class Session:
    source: str  # "file:line", or "synthetic:i"
    arrival_s: float  # from the start of the run
    turns: tuple[Turn, ...]
    history: tuple[dict[str, Any], ...] = ()  # messages before the first turn (a conversation's system prompt)
    replies: tuple[str | None, ...] = ()  # per turn: the recorded reply that goes into the history (None: the model's)


@dataclass(frozen=True)
class WorkloadOptions:
    model: str = ""  # traces, conversations and synthetic name no model: this one
    limit: int | None = None  # at most this many sessions per file
    time_scale: float = 1.0  # trace timestamps multiplied by this
    rate: float | None = None  # sessions/s: gamma arrivals replace the files' times
    burstiness: float = 1.0  # the gamma shape: 1 is Poisson, below 1 burstier
    seed: int = 0
    max_input_tokens: int | None = None  # traces and synthetic: prompts cut to this
    max_output_tokens: int | None = None  # traces, synthetic, conversations: max_tokens capped (conversations: set)
    strict: bool = False  # a malformed line fails the load instead of being skipped

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise WorkloadError(f"--limit must be positive, not {self.limit}")
        if self.time_scale <= 0:
            raise WorkloadError(f"--time-scale must be positive, not {self.time_scale}")
        if self.rate is not None and self.rate <= 0:
            raise WorkloadError(f"--rate must be positive, not {self.rate}")
        if self.burstiness <= 0:
            raise WorkloadError(f"--burstiness must be positive, not {self.burstiness}")
        for name in ("max_input_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise WorkloadError(f"--{name.replace('_', '-')} must be positive, not {value}")


@dataclass
class EvalWorkload:
    sessions: list[Session]
    identity: str  # sha256 of every source's bytes and every option that shapes the requests
    sources: list[str]
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of each malformed line skipped

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def load(sources: list[str], options: WorkloadOptions, warn: Any = None) -> EvalWorkload:
    """Every source's sessions, arrival times set; `warn(text)` hears each skipped line."""
    digest = hashlib.sha256(json.dumps(asdict(options), sort_keys=True).encode())
    sessions: list[Session] = []
    skipped: list[str] = []
    for source in sources:
        if source.startswith("synthetic:"):
            digest.update(source.encode())
            sessions += _synthetic(source, options)
            continue
        path = Path(source)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise WorkloadError(f"{source}: cannot read the workload: {exc.strerror or exc}") from exc
        digest.update(hashlib.sha256(data).digest())
        for problem, session in _parse_file(source, data, options):
            if problem is not None:
                if options.strict:
                    raise WorkloadError(problem)
                skipped.append(problem)
                if warn is not None:
                    warn(f"skipped {problem}")
            elif session is not None:
                sessions.append(session)
    if not sessions:
        raise WorkloadError(f"no usable request in {', '.join(sources)}")
    if options.rate is not None:
        sessions = _with_gamma_arrivals(sessions, options)
    sessions.sort(key=lambda s: s.arrival_s)
    return EvalWorkload(sessions, digest.hexdigest(), list(sources), skipped)


def _parse_file(source: str, data: bytes, options: WorkloadOptions) -> Iterator[tuple[str | None, Session | None]]:
    """(problem, None) for a malformed line, (None, session) for a good one; stops at --limit sessions."""
    kind = ""
    first_timestamp: float | None = None
    taken = 0
    for number, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{source}:{number}"
        try:
            line = json.loads(raw)
            if not isinstance(line, dict):
                raise WorkloadError("a line must be a JSON object")
            kind = kind or _kind_of(line)
            if kind == "trace":
                first_timestamp = _number(line, "timestamp") if first_timestamp is None else first_timestamp
                session = _trace_session(where, line, first_timestamp, options)
            elif kind == "requests":
                session = _request_session(where, line)
            else:
                session = _conversation_session(where, line, options)
        except json.JSONDecodeError as exc:
            yield f"{where}: not JSON ({exc.msg} at column {exc.colno})", None
            continue
        except WorkloadError as exc:
            yield f"{where}: {exc}", None
            continue
        yield None, session
        taken += 1
        if options.limit is not None and taken >= options.limit:
            return


def _kind_of(line: dict[str, Any]) -> str:
    if "hash_ids" in line:
        return "trace"
    if "body" in line:
        return "requests"
    if "conversations" in line or "messages" in line:
        return "conversations"
    raise WorkloadError(
        "not a workload line: a Mooncake trace line has hash_ids, a request line body, a conversation "
        "conversations or messages"
    )


def _number(line: dict[str, Any], key: str, minimum: float = 0) -> float:
    value = line.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise WorkloadError(f"{key} must be a number >= {minimum:g}, not {value!r}")
    return float(value)


def _capped(value: int, cap: int | None) -> int:
    return value if cap is None else min(value, cap)


def _trace_session(where: str, line: dict[str, Any], first_ms: float, options: WorkloadOptions) -> Session:
    timestamp = _number(line, "timestamp")
    input_length = _capped(int(_number(line, "input_length", 1)), options.max_input_tokens)
    output_length = _capped(int(_number(line, "output_length", 1)), options.max_output_tokens)
    hash_ids = line["hash_ids"]
    if not isinstance(hash_ids, list) or not hash_ids or not all(isinstance(h, int) for h in hash_ids):
        raise WorkloadError("hash_ids must be a non-empty list of integers")
    body = {
        "model": options.model,
        "messages": [{"role": "user", "content": trace_prompt(hash_ids, input_length)}],
        "max_tokens": output_length,
        "ignore_eos": True,  # the trace's output length, not the model's choice of when to stop
    }
    arrival = max(0.0, timestamp - first_ms) / 1000 * options.time_scale
    return Session(where, arrival, (Turn("chat", body),))


def _request_session(where: str, line: dict[str, Any]) -> Session:
    api = line.get("api", "chat")
    if api not in APIS:
        raise WorkloadError(f"api must be one of {', '.join(APIS)}, not {api!r}")
    body = line["body"]
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise WorkloadError("body must be an object with a model")
    expected = line.get("expected_text")
    if expected is not None and not isinstance(expected, str):
        raise WorkloadError("expected_text must be a string")
    checks = line.get("checks", [])
    if not isinstance(checks, list):
        raise WorkloadError("checks must be a list")
    return Session(where, 0.0, (Turn(api, body, expected, tuple(_check(c, body) for c in checks)),))


def _check(raw: Any, body: dict[str, Any]) -> Check:
    if not isinstance(raw, dict) or raw.get("type") not in CHECK_KINDS:
        raise WorkloadError(f"a check must be an object whose type is one of {', '.join(CHECK_KINDS)}: {raw!r}")
    kind = raw["type"]
    if kind == "tool_call":
        if not body.get("tools"):
            raise WorkloadError("a tool_call check needs tools in the body")
        return Check(kind, str(raw.get("name", "")))
    if kind == "json_schema":
        if not isinstance(body.get("response_format") or body.get("text"), dict):
            raise WorkloadError("a json_schema check needs a response_format (chat) or text.format (responses)")
        return Check(kind)
    key = "value" if kind == "contains" else "pattern"
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"a {kind} check needs a non-empty string {key}")
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            raise WorkloadError(f"the regex check's pattern {value!r} does not compile: {exc}") from None
    return Check(kind, value)


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _conversation_session(where: str, line: dict[str, Any], options: WorkloadOptions) -> Session:
    raw = line.get("conversations", line.get("messages"))
    if not isinstance(raw, list) or not raw:
        raise WorkloadError("conversations (or messages) must be a non-empty list")
    messages = []
    for item in raw:
        if not isinstance(item, dict):
            raise WorkloadError("each message must be an object")
        role = SHAREGPT_ROLES.get(str(item.get("from", item.get("role"))))
        text = item.get("value", item.get("content"))
        if role is None or not isinstance(text, str):
            raise WorkloadError(f"a message needs from/role in {', '.join(SHAREGPT_ROLES)} and a string value/content")
        messages.append({"role": role, "content": text})
    history = tuple(m for m in messages if m["role"] == "system")
    max_tokens = options.max_output_tokens or DEFAULT_CONVERSATION_OUTPUT_TOKENS
    turns: list[Turn] = []
    replies: list[str | None] = []
    for message in (m for m in messages if m["role"] != "system"):
        if message["role"] == "user":
            turns.append(Turn("chat", {"model": options.model, "messages": [message], "max_tokens": max_tokens}))
            replies.append(None)
        elif turns and replies[-1] is None:
            replies[-1] = message["content"]
    if not turns:
        raise WorkloadError("a conversation needs at least one user turn")
    return Session(where, 0.0, tuple(turns), history, tuple(replies))


def _synthetic(spec: str, options: WorkloadOptions) -> list[Session]:
    """synthetic:requests=N,input=TOKENS,output=TOKENS,spread=FRACTION,prefix=FRACTION (lengths uniform in
    mean * (1 +- spread); the first prefix * input tokens the same in every request)."""
    values = {"requests": 20.0, "input": 256.0, "output": 32.0, "spread": 0.0, "prefix": 0.0}
    for item in filter(None, spec.removeprefix("synthetic:").split(",")):
        key, _, value = item.partition("=")
        if key not in values:
            raise WorkloadError(f"{spec}: unknown key {key!r} (known: {', '.join(values)})")
        try:
            values[key] = float(value)
        except ValueError:
            raise WorkloadError(f"{spec}: {key} must be a number, not {value!r}") from None
    if values["requests"] < 1 or values["input"] < 1 or values["output"] < 1:
        raise WorkloadError(f"{spec}: requests, input and output must be at least 1")
    if not (0 <= values["spread"] < 1 and 0 <= values["prefix"] <= 1):
        raise WorkloadError(f"{spec}: spread must be in [0, 1) and prefix in [0, 1]")
    rng = random.Random(options.seed)
    shared = [rng.choice(WORDS) for _ in range(int(values["input"] * values["prefix"]))]
    num_requests = _capped(int(values["requests"]), options.limit)
    sessions = []
    for i in range(num_requests):
        num_input = _capped(_spread(rng, values["input"], values["spread"]), options.max_input_tokens)
        num_output = _capped(_spread(rng, values["output"], values["spread"]), options.max_output_tokens)
        body = {
            "model": options.model,
            "messages": [{"role": "user", "content": synthetic_prompt(rng, num_input, shared)}],
            "max_tokens": num_output,
            "ignore_eos": True,
        }
        sessions.append(Session(f"synthetic:{i}", 0.0, (Turn("chat", body),)))
    return sessions


def _spread(rng: random.Random, mean: float, spread: float) -> int:
    return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


def _with_gamma_arrivals(sessions: list[Session], options: WorkloadOptions) -> list[Session]:
    """Gamma inter-arrival gaps of mean 1/rate and shape `burstiness` (vLLM's and aiperf's definition)."""
    assert options.rate is not None
    rng = random.Random(options.seed)
    clock = 0.0
    timed = []
    for session in sessions:
        timed.append(Session(session.source, clock, session.turns, session.history, session.replies))
        clock += rng.gammavariate(options.burstiness, 1 / (options.rate * options.burstiness))
    return timed
