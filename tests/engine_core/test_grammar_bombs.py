"""Grammar bombs against the compile pool (engine_core.structured_output.GrammarCompiler.compile_async) with
deepseek-tiny's real 129k-token vocabulary: each bomb compiles or is refused within 2 s; a compile past its
deadline is refused but keeps its slot until it really ends (an xgrammar compile cannot be interrupted); the pool
refuses at once past its caps (in all, per tenant); 10,000 distinct schemas in a row keep the cache under its byte
bound and the process's memory bounded."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from engine_core import model_store
from engine_core.structured_output import GrammarBusyError, GrammarCompiler, GrammarError, StructuredOutput
from engine_core.tokenizer import Tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")
VOCAB_SIZE = 129280  # deepseek-tiny's logits' width


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    loaded = Tokenizer.from_dir(model_store.ensure("deepseek-tiny"))
    assert loaded is not None
    return loaded


def compiler(tokenizer: Tokenizer, **limits: int) -> GrammarCompiler:
    made = GrammarCompiler(tokenizer, VOCAB_SIZE, [1], **limits)
    made._xgr_compiler()  # the vocabulary's tables, once (seconds): not part of any timing below
    return made


@pytest.fixture(scope="module")
def shared(tokenizer: Tokenizer) -> GrammarCompiler:
    return compiler(tokenizer)


def schema(value: object) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(value))


def slow_bomb(salt: int = 0) -> StructuredOutput:
    """A 20,000-entry enum: about 2 s and 35 MB to compile on this machine (the gateway's checks refuse it; a
    worker must survive it anyway)."""
    return schema({"enum": [f"v{salt}-{i}" for i in range(20_000)]})


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


async def within_2s(grammars: GrammarCompiler, structured: StructuredOutput) -> str:
    start = time.monotonic()
    try:
        await grammars.compile_async(structured, timeout_s=1.5)
        outcome = "compiled"
    except GrammarError as exc:
        outcome = str(exc)
    assert time.monotonic() - start < 2.0
    return outcome


async def test_nesting_and_recursion_compile_quickly(shared: GrammarCompiler) -> None:
    nested: dict[str, object] = {"type": "integer"}
    for _ in range(30):
        nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
    node = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"],
    }
    recursive = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    self_loop = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}  # a reference to itself, no content
    assert await within_2s(shared, schema(nested)) == "compiled"
    assert await within_2s(shared, schema(recursive)) == "compiled"
    assert shared.is_cached(schema(nested)) and shared.is_cached(schema(recursive))
    outcome = await within_2s(shared, schema(self_loop))
    assert outcome == "compiled" or "grammar" in outcome


async def test_a_50000_entry_enum_is_refused_by_its_size() -> None:
    with pytest.raises(GrammarError, match="characters; at most 262144 are allowed"):
        schema({"enum": list(range(50_000))})


class SlowToPrepare(Tokenizer):
    """A tokenizer whose vocabulary takes a second to hand over, as a large one does on a loaded machine."""

    @property  # type: ignore[override]
    def backend(self) -> Any:
        time.sleep(1.0)
        return self._backend

    @backend.setter
    def backend(self, value: Any) -> None:
        self._backend = value


async def test_the_first_grammar_does_not_pay_for_the_vocabulary_within_its_deadline(tokenizer: Tokenizer) -> None:
    """The model's one-off preparation (xgrammar's tables over the vocabulary) runs before the deadline starts:
    a loaded worker's first grammar must not fail for it, nor may the event loop wait on it."""
    slow = SlowToPrepare(tokenizer.backend, eos_token=tokenizer.eos_token)
    grammars = GrammarCompiler(slow, VOCAB_SIZE, [1])
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    start = time.monotonic()
    await grammars.compile_async(schema({"type": "integer"}), timeout_s=0.5)
    elapsed = time.monotonic() - start
    ticker.cancel()
    assert elapsed > 1.0 and grammars.is_cached(schema({"type": "integer"}))
    assert ticks >= 10  # the loop ran on while the vocabulary was prepared on another thread


async def test_a_compile_past_its_deadline_is_refused_and_keeps_its_slot(tokenizer: Tokenizer) -> None:
    grammars = compiler(tokenizer, num_threads=1)
    start = time.monotonic()
    with pytest.raises(GrammarError, match=r"took over 0\.3 s to compile"):
        await grammars.compile_async(slow_bomb(), timeout_s=0.3)
    assert time.monotonic() - start < 1.0
    assert grammars.num_pending == 1  # still compiling: the slot is not handed to anyone else yet
    deadline = time.monotonic() + 30
    while grammars.num_pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert grammars.num_pending == 0
    assert grammars.is_cached(slow_bomb())  # it ended and was kept (35 MB < the 256 MiB bound)


async def test_the_pool_refuses_at_once_past_its_caps(tokenizer: Tokenizer) -> None:
    grammars = compiler(tokenizer, num_threads=1, max_pending=3, max_pending_per_tenant=2)
    bombs = [slow_bomb(i) for i in range(5)]  # built first: 20,000 entries each take a moment to write
    running = [asyncio.ensure_future(grammars.compile_async(bombs[i], 30.0, tenant="a")) for i in range(2)]
    await asyncio.sleep(0)
    assert grammars.num_pending == 2
    start = time.monotonic()
    with pytest.raises(GrammarBusyError, match="2 grammar compiles of this tenant are already pending"):
        await grammars.compile_async(bombs[2], 30.0, tenant="a")
    other = asyncio.ensure_future(grammars.compile_async(bombs[3], 30.0, tenant="b"))  # another tenant fits
    await asyncio.sleep(0)
    with pytest.raises(GrammarBusyError, match="3 grammar compiles are already pending"):
        await grammars.compile_async(bombs[4], 30.0)
    assert time.monotonic() - start < 0.1  # refused without waiting
    other.cancel()  # a queued compile whose caller leaves never starts: its slot comes back
    await asyncio.gather(*running, return_exceptions=True)
    deadline = time.monotonic() + 30
    while grammars.num_pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert grammars.num_pending == 0
    assert not grammars.is_cached(bombs[3])


async def test_10000_distinct_schemas_keep_the_cache_under_its_byte_bound(tokenizer: Tokenizer) -> None:
    grammars = compiler(tokenizer, cache_bytes=2 * 2**20)
    rss_before = rss_bytes()
    slowest = 0.0
    for i in range(10_000):
        start = time.monotonic()
        await grammars.compile_async(schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}), 2.0)
        slowest = max(slowest, time.monotonic() - start)
        assert grammars.num_cached_bytes <= 2 * 2**20
    assert slowest < 2.0
    assert grammars.num_cached_bytes > 2 * 2**20 - 64 * 1024  # full, and evicting (about 80 of 24 KB each)
    assert grammars.is_cached(schema({"type": "object", "properties": {"k9999": {"type": "integer"}}}))
    assert not grammars.is_cached(schema({"type": "object", "properties": {"k0": {"type": "integer"}}}))
    assert rss_bytes() - rss_before < 64 * 2**20
