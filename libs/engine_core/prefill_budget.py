"""How many prompt tokens a step may prefill beside running decodes, priced from measured step times.

A step's time is what every decoding stream waits between two tokens, so prefill work beside decodes is paid
by all of them (Sarathi-Serve's stall-free batching; vLLM's chunked prefill under a token budget). A fixed token
cap (`long_prefill_token_threshold`) cannot suit every model, machine and context: 256 tokens beside 8 streams of
SmolLM2 on 2 CPU cores make a step 10x a decode-only one, and a chunk late in an 8k-token prompt costs more than
an early one, as each of its tokens attends over everything before it.

So the budget prices work, not tokens. A chunk of n tokens after c tokens already in the cache is

    work(c, n) = n + (n * c + n * (n + 1) / 2) / span + c / read_span

token-equivalents: its linear layers, its attention pairs (query, key), and one read of its cached context's K/V
(the chunk kernel reads each cached position once for all its queries; the gather path copies the context, then
attends it). `span` is the context at which one token's attention costs as much as its linear layers, `read_span`
the context whose one read does, both from the model's shape (`PrefillShape.of`). The read is most of what a small
chunk late in a long prompt costs: priced without it, from such chunks, every extra token seemed to cost the
context's read again, and chunks stayed at a few tokens where more fitted (docs/engine.md, "A chunk's price counts
its context's read").

What a unit of work costs is measured: a step with decodes and prefill work takes `decode_ms + ms_per_work * work`,
where decode_ms is the median of recent decode-only steps and ms_per_work the median of (step - decode_ms) / work
over recent steps with prefill work; medians, so that a noisy neighbour's spike moves neither, and recent, so that
the price follows the machine's load and whatever the shape leaves out. A step's prefills together get the work
that keeps it within `step_ratio` x decode_ms. The first prefill of a step always gets at least MIN_CHUNK_TOKENS,
so a long prompt finishes however costly its chunks become; until both costs are measured, prefills get only that
floor, which measures them cheaply.

While a long prompt is prefilled every step carries a chunk, so no step shows what the decodes alone cost now,
and they cost more as the streams' contexts grow (8 streams over an 8k prompt's thousands of steps: a decode-only
step 92 ms before, 230 ms by the end). Priced against a stale decode_ms the budget saw every step as over its aim
and gave the floor alone, so the prompt took 3,877 steps (docs/engine.md). So after REFRESH_STEPS steps in a row
with prefill work, one step runs the decodes alone (the prompt waits a step: 3% more steps at most; asked once, so
short prompts admitted into that step cannot starve it), and decode_ms is the median of the decode-only steps among
the last DECODE_WINDOW_STEPS steps: three refreshes into a prompt only they count (a median of three still ignores
one spike), while the decode-only steps before it came, up to 32 of them, would otherwise outvote the refreshes
for as long as they were in the window (with 256 steps, a slow spell before an 8k prompt priced its first 5,500
tokens against decodes 1.5x dearer than they had become, docs/engine.md).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine_core.config import ModelConfig

# The floor: prompt tokens the first prefill of a step computes whatever the price. Late in a long prompt it is
# what a step costs (the price allows less): with the chunk kernel 2 kept the 8k long-prompt bench's streams
# within 2x where 8 did not, at the same TTFT (docs/engine.md).
MIN_CHUNK_TOKENS = 2
NUM_DECODE_STEPS = 32  # decode-only step times kept (the median of those still recent is decode_ms)
NUM_PREFILL_STEPS = 16  # steps with prefill work kept (the median of their price per unit is ms_per_work)
REFRESH_STEPS = 32  # steps with prefill work in a row after which one runs the decodes alone, to measure them
DECODE_WINDOW_STEPS = 3 * REFRESH_STEPS  # a decode-only step older than this many measured steps sets no decode_ms


# What reading one cached float once costs in multiply-adds, for `read_span`. A machine's balance of memory
# bandwidth and arithmetic, not a shape: fitted to the 8k long-prompt bench's recorded steps on a 2-core Xeon with
# AVX-512 and the chunk kernel (2026-12-07; each step's time beyond its decodes' against its chunk's (c, n)):
# 27.7, 36.6 and 37.5 in three runs (a fourth, whose chunk sizes hardly varied, could not separate the terms). The
# measured price per unit corrects the scale; this sets how a chunk's cost splits between its read and its tokens.
MACS_PER_FLOAT_READ = 32.0


@dataclass(frozen=True)
class PrefillShape:
    """What a chunk's work follows in a model's shape (see the module doc), in token-equivalents."""

    span: float  # context at which one token's attention (q.k and p.v) costs its linear layers
    read_span: float  # cached tokens whose K/V read once costs one token's linear layers (math.inf: not priced)

    @classmethod
    def of(cls, config: ModelConfig) -> PrefillShape:
        """SmolLM2-135M: span 3,072 tokens, read_span 288 (a token's linear layers are 3.5 M multiply-adds a layer,
        its K and V 384 floats). A shape, not a timing: MLA and MoE layers are priced as dense attention and MLP
        of the same sizes (MLA's read is its latent), which the measured price per unit then corrects near the
        contexts actually seen."""
        hidden, head_dim = config.hidden_size, config.head_dim
        linear = (
            2 * hidden * head_dim * (config.num_heads + config.num_kv_heads) + 3 * hidden * config.intermediate_size
        )
        mla = config.mla
        cached = mla.kv_lora_rank + mla.qk_rope_head_dim if mla is not None else 2 * config.num_kv_heads * head_dim
        return cls(linear / (2 * config.num_heads * head_dim), linear / (cached * MACS_PER_FLOAT_READ))

    def work(self, num_cached: int, num_tokens: int) -> float:
        """Token-equivalents of computing `num_tokens` prompt tokens after `num_cached` ones (0 tokens: none)."""
        if num_tokens <= 0:
            return 0.0
        pairs = num_tokens * num_cached + num_tokens * (num_tokens + 1) / 2
        return num_tokens + pairs / self.span + num_cached / self.read_span

    def tokens_within(self, work: float, num_cached: int) -> int:
        """The most tokens whose work after `num_cached` tokens stays within `work` (0 if not even one)."""
        if math.isinf(work):
            return 2**31
        rest = work - num_cached / self.read_span  # what the context's read, paid by any chunk, leaves
        if rest <= 0:
            return 0
        # the rest is a n^2 + b n with a = 1 / (2 span), b = 1 + (c + 1/2) / span: the positive root, floored
        a, b = 1.0 / (2.0 * self.span), 1.0 + (num_cached + 0.5) / self.span
        tokens = int((-b + math.sqrt(b * b + 4.0 * a * rest)) / (2.0 * a))
        while tokens > 0 and self.work(num_cached, tokens) > work:  # the root's rounding, at most a step
            tokens -= 1
        return tokens


class StepAllowance:
    """One step's prefill work left, handed out to the step's prefills in order. Built by `PrefillBudget` for
    one `Scheduler.schedule` call, which is its only user."""

    def __init__(self, work: float, shape: PrefillShape, floor: int = MIN_CHUNK_TOKENS) -> None:
        self.work = work  # token-equivalents left this step (may go negative: the floor overdraws it)
        self.shape = shape
        self.floor = floor  # tokens the first prefill gets whatever the work left (0: a decode-only step)
        self.num_takes = 0

    def take(self, num_cached: int, num_tokens: int) -> int:
        """Tokens (at most `num_tokens`) the next prefill, `num_cached` tokens in, computes this step."""
        fits = self.shape.tokens_within(self.work, num_cached)
        if self.num_takes == 0:
            fits = max(fits, self.floor)
        taken = min(num_tokens, fits)
        if taken > 0:
            self.num_takes += 1
            self.work -= self.shape.work(num_cached, taken)
        return taken


class PrefillBudget:
    """Measured step costs and the prefill work they allow. The scheduler that owns it is its only writer
    (`observe` after each step, `allowance` when it schedules one)."""

    def __init__(self, step_ratio: float, shape: PrefillShape) -> None:
        if step_ratio < 1.0 or shape.span <= 0 or shape.read_span <= 0:
            raise ValueError(f"step_ratio must be at least 1 and spans positive, got {step_ratio!r}, {shape!r}")
        self.step_ratio = step_ratio  # a step with prefill work may take this many decode-only steps
        self.shape = shape
        self._num_steps = 0  # steps measured (those with decodes)
        self._refreshed_at = 0  # the step number of the last decode-only step asked for
        self._decode_ms: deque[tuple[int, float]] = deque(maxlen=NUM_DECODE_STEPS)  # (step number, ms)
        self._prefill_steps: deque[tuple[float, float]] = deque(maxlen=NUM_PREFILL_STEPS)  # (ms, work)

    def observe(self, num_decodes: int, chunks: Sequence[tuple[int, int]], ms: float) -> None:
        """One step's time: `num_decodes` single-token rows and the prefill chunks (num_cached, num_tokens)."""
        if num_decodes == 0:
            return  # nothing waited on it: prefill alone has the whole budget
        self._num_steps += 1
        if not chunks:
            self._decode_ms.append((self._num_steps, ms))
            return
        self._prefill_steps.append((ms, sum(self.shape.work(c, n) for c, n in chunks)))

    @property
    def decode_ms(self) -> float | None:
        """Median of the decode-only steps among the last DECODE_WINDOW_STEPS (of all kept, if none is)."""
        if not self._decode_ms:
            return None
        recent = [ms for step, ms in self._decode_ms if step > self._num_steps - DECODE_WINDOW_STEPS]
        return statistics.median(recent or [ms for _, ms in self._decode_ms])

    @property
    def ms_per_work(self) -> float | None:
        """Median price of one token-equivalent over the recent steps with prefill work (None: none yet)."""
        decode_ms = self.decode_ms
        if decode_ms is None or not self._prefill_steps:
            return None
        return statistics.median((ms - decode_ms) / work for ms, work in self._prefill_steps)

    def allowance(self) -> StepAllowance:
        """The prefill work this step may add beside its decodes: none, not even the floor, when REFRESH_STEPS
        steps in a row had prefill work (this one measures the decodes alone)."""
        if self._decode_ms and self._num_steps - max(self._decode_ms[-1][0], self._refreshed_at) >= REFRESH_STEPS:
            # asked for once: if short prompts (not priced) fill this step anyway, the long one waits no longer
            self._refreshed_at = self._num_steps
            return StepAllowance(0.0, self.shape, floor=0)
        decode_ms, ms_per_work = self.decode_ms, self.ms_per_work
        if decode_ms is None or ms_per_work is None:
            work = 0.0  # not measured yet: the floor alone
        elif ms_per_work <= 0:
            work = math.inf  # prefill costs nothing measurable here: only the token caps bound it
        else:
            work = (self.step_ratio - 1.0) * decode_ms / ms_per_work
        return StepAllowance(work, self.shape)
