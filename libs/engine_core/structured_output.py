"""Structured output: a grammar travels with a request (`SamplingParams.structured_output`) and masks every
token it samples, wherever the request runs (prefill samples the first token, decode the rest).

    StructuredOutput    what the request asks for: a grammar kind and its text (the wire form)
    build_grammar       the kind + text as an xgrammar Grammar, with no tokenizer (cheap: the gateway uses it
                        to refuse a bad grammar before routing)
    GrammarCompiler     one per engine (so per model): the grammar bound to the model's vocabulary, compiled
                        once per distinct StructuredOutput on its own few threads and kept in an LRU cache
                        bounded in bytes
    grammar_mask        a SamplingParams.token_mask hook over a GrammarMatcher: it advances over the output
                        tokens it has not seen yet (on decode: the token prefill sampled) before masking

Compilation is bounded: the text's size is capped here, and the services compile off the engine thread with
a deadline (`AsyncEngine.prepare_grammar` -> `GrammarCompiler.compile_async`), so a grammar blow-up fails the
request, not the worker. An xgrammar compile cannot be interrupted, so a compile past its deadline is refused to
its request but keeps its thread and its place in the counts until it really ends: at most `num_threads` compiles
run at once and at most `max_pending` are queued or running (per tenant `max_pending_per_tenant`, when the caller
names one), so a flood of bombs is refused at once instead of piling up behind each other.
xgrammar is imported lazily: it pulls in transformers, which costs seconds at import.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar

    from engine_core.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar's text (tool grammars embed each tool's JSON grammar)
CACHE_BYTES = 256 * 2**20  # compiled grammars kept per engine, by their size (xgrammar's memory_size_bytes)
COMPILE_THREADS = 2  # compiles running at once per engine
MAX_PENDING_COMPILES = 16  # queued or running per engine; more is refused at once
PREPARE_TIMEOUT_S = 120.0  # for the first grammar's one-off preparation of the vocabulary
MAX_PENDING_COMPILES_PER_TENANT = 4  # of those, for one tenant (when the caller names the tenant)

# A per-request token mask hook (SamplingParams.token_mask): given the tokens generated so far, the vocabulary
# entries allowed next ((V,) bool, True = allowed), or None for no restriction. Grammars plug in here.
TokenMaskFn = Callable[[Sequence[int]], "torch.Tensor | None"]


class GrammarError(ValueError):
    """A grammar that cannot be built or compiled: the request's fault (INVALID_ARGUMENT, HTTP 400)."""


class GrammarBusyError(GrammarError):
    """Too many compiles are queued or running (for this worker or tenant): refused at once, retry later."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str  # the schema (JSON text), regex, EBNF or structural tag (JSON text); "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (known: {', '.join(KINDS)})")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar is {len(self.spec)} characters; at most {MAX_GRAMMAR_CHARS} are allowed")


# json_object: any JSON object. Compact separators like json_schema's; whitespace-free output also keeps a
# weak model from filling its budget with blank lines.
_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


def build_grammar(structured: StructuredOutput) -> xgrammar.Grammar:
    """The grammar, checked for syntax, without a tokenizer. Raises GrammarError."""
    import xgrammar as xgr

    try:
        if structured.kind == "json_schema":
            return xgr.Grammar.from_json_schema(structured.spec, any_whitespace=False)
        if structured.kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if structured.kind == "regex":
            return xgr.Grammar.from_regex(structured.spec)
        if structured.kind == "ebnf":
            return xgr.Grammar.from_ebnf(structured.spec)
        return xgr.Grammar.from_structural_tag(structured.spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as these
        raise GrammarError(f"invalid {structured.kind} grammar: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    message = text[0] if text else type(exc).__name__
    # xgrammar prefixes "[time] /path/file.cc:line: "; the rest is the message
    return message.split(": ", 1)[1] if message.startswith("[") and ": " in message else message


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of our tokenizer: its vocabulary (decoded from the `tokenizers` backend, byte-level or
    byte-fallback as detected), padded to the model's vocab_size (the logits' width), and the stop tokens
    a finished grammar allows."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarCompiler:
    """One model's compiled grammars. Thread-safe: the services compile on this compiler's own threads
    (`compile_async`), and the engine thread looks grammars up (compiling only on a cache miss) when a request is
    added."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_bytes: int = CACHE_BYTES,
        num_threads: int = COMPILE_THREADS,
        max_pending: int = MAX_PENDING_COMPILES,
        max_pending_per_tenant: int = MAX_PENDING_COMPILES_PER_TENANT,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self.cache_bytes = cache_bytes
        self.max_pending = max_pending
        self.max_pending_per_tenant = max_pending_per_tenant
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on first use (seconds for a large vocab)
        # structured -> (compiled, its bytes: xgrammar's memory_size_bytes plus the key's text)
        self._cache: collections.OrderedDict[StructuredOutput, tuple[xgrammar.CompiledGrammar, int]] = (
            collections.OrderedDict()
        )
        self.num_cached_bytes = 0
        self._pending: dict[str, int] = {}  # tenant ("" unnamed) -> compiles queued or running, until they end
        self._lock = threading.Lock()  # guards _cache, num_cached_bytes and _pending
        self._compiler_lock = threading.Lock()  # guards _compiler while it is built (seconds: never on the loop)
        self._threads = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")

    @property
    def num_pending(self) -> int:
        """Compiles queued or running, counted until each really ends (a refused one may still be running)."""
        with self._lock:
            return sum(self._pending.values())

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise GrammarError("this model has no tokenizer, so it cannot follow a grammar")
                info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar, from the cache or compiled on the calling thread."""
        with self._lock:
            entry = self._cache.get(structured)
            if entry is not None:
                self._cache.move_to_end(structured)
                return entry[0]
        grammar = build_grammar(structured)
        try:
            compiled = self._xgr_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"the {structured.kind} grammar does not compile: {_first_line(exc)}") from None
        self._keep(structured, compiled)
        return compiled

    def _keep(self, structured: StructuredOutput, compiled: xgrammar.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes) + len(structured.spec)
        if size > self.cache_bytes:
            return  # larger than the whole cache: used once, not kept
        with self._lock:
            if structured in self._cache:
                return
            self._cache[structured] = (compiled, size)
            self.num_cached_bytes += size
            while self.num_cached_bytes > self.cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self.num_cached_bytes -= evicted

    async def compile_async(self, structured: StructuredOutput, timeout_s: float, tenant: str = "") -> None:
        """Compile into the cache on this compiler's threads. GrammarBusyError at once when too many compiles
        are pending (for the tenant, when named); GrammarError past `timeout_s` (the compile runs on, holding
        its thread and its count, and is cached if it ends)."""
        if self.is_cached(structured):
            return
        if self._compiler is None:  # xgrammar's import and the vocabulary's preparation: the worker's one-off
            # cost (seconds on a loaded machine), paid outside this grammar's deadline, once, on its own thread
            try:
                await asyncio.wait_for(asyncio.to_thread(self._xgr_compiler), PREPARE_TIMEOUT_S)
            except (asyncio.TimeoutError, TimeoutError):
                raise GrammarBusyError("this worker is still preparing grammars for its model; retry shortly") from None
        with self._lock:
            if sum(self._pending.values()) >= self.max_pending:
                raise GrammarBusyError(f"{self.max_pending} grammar compiles are already pending; retry shortly")
            if tenant and self._pending.get(tenant, 0) >= self.max_pending_per_tenant:
                raise GrammarBusyError(
                    f"{self.max_pending_per_tenant} grammar compiles of this tenant are already pending; retry shortly"
                )
            self._pending[tenant] = self._pending.get(tenant, 0) + 1
        deadline = time.monotonic() + timeout_s
        try:
            future = self._threads.submit(self._compile_by, structured, deadline)
        except BaseException:
            self._release(tenant)
            raise
        future.add_done_callback(lambda _: self._release(tenant))  # when it really ends (or never started)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)  # cancels it if it has not started
        except (asyncio.TimeoutError, TimeoutError):
            raise GrammarError(f"the {structured.kind} grammar took over {timeout_s:g} s to compile") from None

    def _compile_by(self, structured: StructuredOutput, deadline: float) -> None:
        if time.monotonic() > deadline:  # waited in the queue past its deadline: its caller is gone
            raise GrammarError("the grammar compile waited past its deadline")
        self.compile(structured)

    def _release(self, tenant: str) -> None:
        with self._lock:
            self._pending[tenant] -= 1
            if not self._pending[tenant]:
                del self._pending[tenant]

    def is_cached(self, structured: StructuredOutput) -> bool:
        with self._lock:
            return structured in self._cache

    def token_mask(self, structured: StructuredOutput) -> TokenMaskFn:
        return grammar_mask(self.compile(structured), self._vocab_size)


def grammar_mask(compiled: Any, vocab_size: int) -> TokenMaskFn:
    """A token_mask hook for one request. The matcher is the hook's own state, written only by the hook (on
    the engine thread): it accepts each output token it has not seen, then says which tokens may follow."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32
    shifts = torch.arange(32, dtype=torch.int32)
    num_accepted = 0

    def mask(output_token_ids: Sequence[int]) -> torch.Tensor | None:
        nonlocal num_accepted
        assert len(output_token_ids) >= num_accepted, "output tokens never shrink"
        for token_id in output_token_ids[num_accepted:]:
            if matcher.is_terminated():  # ignore_eos past the grammar's end: only stop tokens stay allowed
                break
            if not matcher.accept_token(token_id):  # impossible unless something overrode the mask
                raise GrammarError(f"token {token_id} breaks the grammar")
        num_accepted = len(output_token_ids)
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask)
        bits = (bitmask[0, :, None] >> shifts) & 1  # (ceil(V / 32), 32): bit j of word i is token 32 i + j
        return bits.reshape(-1)[:vocab_size].bool()  # (V,)

    return mask
