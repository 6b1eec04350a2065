"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

Every request is described by one number, `num_computed_tokens`, against its known tokens (prompt plus
outputs so far): each step the scheduler gives each running request the tokens it still lacks (1 for a
decoding request, a chunk for a prefilling one) under a token budget, then admits waiting requests in
arrival order. When blocks run out, the most recently arrived running request is preempted: its blocks
are freed (they stay in the prefix cache until evicted) and it goes back to the head of the queue,
to be recomputed. Arrival order decides both admission and preemption, so the oldest request always
makes progress and none starves; a request alone always fits (the engine caps the context at the cache's
capacity), so none deadlocks.

Decodes come first in the token budget, whatever their arrival order: a prefill only takes what the running
decodes leave. While any request decodes, all prefills together compute at most `long_prefill_token_threshold`
tokens a step (vLLM's knob of that name): a step's time is what every running stream waits between two tokens,
so a long prompt arriving is prefilled in small chunks beside them instead of stalling them for whole seconds.
With a `PrefillBudget` (the engine's default) the chunks of long prompts (over that cap) are also priced: a step's
long prefills get the work that keeps the step within a multiple of a decode-only step, from measured step times,
chunks late in a long prompt costing more than early ones (`prefill_budget.py`); the token cap stays their upper
bound. Short prompts are not priced: a burst of them is what continuous batching is for. With nothing decoding, a
prefill takes the whole budget.

The scheduler is the only writer of the queues and of each request's status, tokens and progress.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.prefill_budget import PrefillBudget, StepAllowance
from engine_core.request import Request, RequestStatus, TokenLogprobs


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed for it this step, starting at request.num_computed_tokens
    block_ids: tuple[int, ...]  # its whole block table after this step's allocation
    state_slot: int = -1  # its slot in the model's per-sequence state pools (-1: the model keeps none)

    @property
    def needs_sample(self) -> bool:
        """Whether this step reaches the request's last known token (so its logits give the next token)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]  # single-token requests first, then multi-token (prefill) ones
    preempted_ids: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a token, a finish, or both)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_scheduled_at: float | None = None  # time.monotonic() when the request was first scheduled (None: never)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0  # prefill tokens a step while any request decodes (0: no cap)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, budget: PrefillBudget | None = None) -> None:
        self.config = config
        self.kv = kv
        self.work_budget = budget  # prices prefill work beside decodes (None: the token cap alone)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # arrival order
        self.requests: dict[str, Request] = {}
        self._finished_outputs: list[RequestOutput] = []  # finishes that happened outside a step (aborts)
        self.num_prompt_tokens_computed = 0  # prompt tokens whose KV this engine computed
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        if request.status == RequestStatus.WAITING:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_outputs)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return False
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED, force_free=True)
        self._finished_outputs.append(_output(request, [], []))
        return True

    def release(self, request_id: str) -> None:
        """Free a finished request kept for KV export, and forget it."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def start_running(self, request: Request) -> None:
        """Move an imported request (its KV complete) into the running batch."""
        assert request.status == RequestStatus.IMPORTING
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_seq)

    # -- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_decodes_ahead = sum(1 for r in self.running if _is_decoding(r))  # decodes not yet given their token
        prefill_budget = self._prefill_budget(num_decodes_ahead > 0)
        allowance = self.work_budget.allowance() if self.work_budget is not None and self._is_streaming() else None
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            is_prefill = not _is_decoding(request)
            if is_prefill:  # it leaves a token for each decode behind it, and keeps under the prefill cap
                num_new = min(
                    request.num_tokens - request.num_computed_tokens, budget - num_decodes_ahead, prefill_budget
                )
                if allowance is not None and num_new > 0 and self._is_long(request):
                    num_new = allowance.take(request.num_computed_tokens, num_new)
                if num_new <= 0:
                    index += 1
                    continue
            else:
                num_decodes_ahead -= 1
                num_new = 1
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the latest arrival
                if victim is not request and _is_decoding(victim):
                    num_decodes_ahead -= 1
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                prefill_budget -= num_new if is_prefill else 0
                index += 1
        if not preempted:
            self._admit_waiting(min(budget, prefill_budget), scheduled, allowance)
        scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # stable: decodes first, each group in order
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _prefill_budget(self, is_decoding: bool) -> int:
        """Prompt tokens all prefills may compute this step: capped only while some request decodes."""
        threshold = self.config.long_prefill_token_threshold
        if is_decoding and threshold > 0:
            return threshold
        return self.config.max_num_batched_tokens

    def _is_long(self, request: Request) -> bool:
        """Whether the budget prices this prompt: one over the token cap (all of them when the cap is off). A
        burst of short prompts is what continuous batching is for: priced, 32 of them arriving together
        trickled in beside the first to stream and halved the engine's throughput (`kvmesh bench engine`)."""
        return request.num_prompt_tokens > self.config.long_prefill_token_threshold

    def _is_streaming(self) -> bool:
        """Whether a running request has streamed a token and waits for its next: the time the budget protects (a
        prompt whose last token alone is left, all the rest cached, waits for its first)."""
        return any(r.num_output_tokens > 0 and _is_decoding(r) for r in self.running)

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], allowance: StepAllowance | None = None
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if allowance is not None and self._is_long(request):
                num_new = allowance.take(num_hit_tokens, num_new)
            if num_new <= 0:
                break
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.first_scheduled_at is None:
                request.first_scheduled_at = time.monotonic()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                self.num_prefix_hit_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """How long the model took for `output` (forward pass and sampling), for the prefill budget. Call it before
        `update`, while each request's progress still says where its chunk started."""
        if self.work_budget is None:
            return
        chunks = [(s.request.num_computed_tokens, s.num_new_tokens) for s in output.scheduled if s.num_new_tokens > 1]
        self.work_budget.observe(len(output.scheduled) - len(chunks), chunks, seconds * 1e3)

    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, TokenLogprobs] | None = None,
    ) -> list[RequestOutput]:
        """Advance every scheduled request by the tokens computed and append the sampled ones."""
        results, self._finished_outputs = self._finished_outputs, []
        for item in output.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:  # aborted while the step ran
                continue
            start = request.num_computed_tokens
            request.num_computed_tokens += item.num_new_tokens
            self.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - start
            )
            self.kv.cache_computed_blocks(request)
            if request.request_id not in sampled:
                continue
            request.append_output_token(sampled[request.request_id])
            new_logprobs = []
            if logprobs is not None and request.request_id in logprobs:
                new_logprobs = [logprobs[request.request_id]]
                request.logprobs.extend(new_logprobs)
            reason = request.stop_reason()
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
            results.append(_output(request, [request.output_token_ids[-1]], new_logprobs))
        return results

    def requeue(self, request: Request) -> None:
        """Send a running request back to waiting, to recompute from scratch: KV it read turned out bad (a load
        from a KV store failed mid-step, before this step's update)."""
        if request.status != RequestStatus.RUNNING:
            return
        self.running.remove(request)
        self.num_prefix_hit_tokens -= max(request.num_cached_tokens, 0)
        request.num_cached_tokens = -1
        self._preempt(request)

    # -- helpers -------------------------------------------------------------------------------------
    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        request_id = request.request_id
        return ScheduledRequest(request, num_new, tuple(self.kv.block_ids(request_id)), self.kv.state_slot(request_id))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: RequestStatus, force_free: bool = False) -> None:
        request.status = reason
        if force_free or not request.keep_kv:
            self.kv.free(request)
            self.requests.pop(request.request_id, None)


def _is_decoding(request: Request) -> bool:
    """Whether the request needs exactly one token this step: it decodes (or its prompt lacks only its last)."""
    return request.num_tokens - request.num_computed_tokens == 1


def _output(request: Request, new_token_ids: list[int], new_logprobs: list[TokenLogprobs]) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finished=request.status.is_finished,
        finish_reason=request.status.value if request.status.is_finished else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        new_logprobs=new_logprobs,
        first_scheduled_at=request.first_scheduled_at,
    )
