"""The routing simulator behind `kvmesh bench route`: a trace replayed, event by event, through the real routers
(`mesh.routing.Router`, one per balancer replica) over simulated workers that run by the cost model.

- Prefill workers serve their queue in order. At the start of a request a worker looks up the longest prefix of
  its blocks in its own cache (a hit touches them) and computes the rest (`CostModel.prefill_s`); at the end the
  new blocks enter its cache (evicting by `eviction`, LRU by default, within `cache_tokens`) and the global KV
  index hears it, as it would from the worker's KV events. The first token is out then (TTFT).
- The KV then travels to the decode worker (`CostModel.transfer_s`) and joins its continuous batch at the next
  step. The decode worker is the one the router chose at the arrival (`decode_binding` early), or the one the
  same router's `bind_decode` chooses at prefill's end, when the KV is ready (late: as live prefill asks
  Balancer.BindDecode, the choice shared with peer replicas like a route's). A step takes
  `CostModel.decode_step_s` of the worker's KV and adds one token to every running request.
- Every worker reports (WorkerState) every `heartbeat_s`, at staggered phases; between reports each router counts
  its own assignments at once and its peers' `share_delay_s` later (none when `share` is off). Requests go to
  replicas in turn, as gateways spread them.
- A request that leaves a decode worker is heard by every router `share_delay_s` later (the decode workers'
  finished-request feed on NATS), unless `finish_feed` is off; routers then learn only output lengths.
- `seed` 0 staggers the heartbeats evenly in worker order; any other seed draws each worker's phase at random from
  it. The simulation is otherwise deterministic, so seeds show how much a figure owes to where reports fall.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.bench.route_trace import TraceRequest
from mesh.eviction.policies import make_policy
from mesh.kv_index import GlobalKVIndex
from mesh.routing import Assignment, CostModel, Router, RouteRequest, WorkerState

ARRIVE, PREFILL_DONE, DECODE_JOIN, STEP_DONE, HEARTBEAT, PEER, FINISHED = range(7)


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 8
    num_decode: int = 8
    cache_tokens: int = 3_000_000  # per prefill worker
    block_tokens: int = 512
    eviction: str = "lru"
    heartbeat_s: float = 1.0
    num_replicas: int = 1
    share: bool = True
    share_delay_s: float = 0.005
    finish_feed: bool = True
    decode_max_seqs: int = 1024
    decode_kv_tokens: int = 8_000_000  # per decode worker: what normalised decode policies divide by
    cost: CostModel = field(default_factory=CostModel)
    record_series: bool = False
    seed: int = 0  # 0: heartbeats evenly staggered in worker order; else each worker's phase drawn from the seed
    decode_binding: str = "early"  # early: decode chosen at the arrival; late: at prefill's end (Router.bind_decode)


@dataclass
class SimResult:
    ttft_s: list[float]  # per request, trace order
    tpot_s: list[float | None]  # None: one output token, nothing decoded
    num_hit_blocks: int
    num_blocks: int
    prefill_busy_s: list[float]  # per prefill worker
    decode_efficiency: float
    series_s: list[float] = field(default_factory=list)  # sample times (with record_series)
    prefill_queue_series: list[list[int]] = field(default_factory=list)  # per worker: queued prompt tokens
    decode_kv_series: list[list[int]] = field(default_factory=list)  # per worker: KV tokens


class _Prefill:
    def __init__(self, worker_id: str, capacity_blocks: int, eviction: str) -> None:
        self.worker_id = worker_id
        self.capacity_blocks = capacity_blocks
        self.eviction = make_policy(eviction, capacity_blocks)
        self.held: set[bytes] = set()
        self.queue: deque[int] = deque()  # requests waiting
        self.num_queued_tokens = 0  # their prompts (as an engine counts a waiting request: cache hits come later)
        self.current: int | None = None
        self.current_tokens = 0
        self.current_start_s = self.current_end_s = 0.0
        self.busy_s = 0.0

    def num_leading(self, keys: Sequence[bytes]) -> int:
        return next((n for n, key in enumerate(keys) if key not in self.held), len(keys))

    def remaining_tokens(self, now_s: float) -> int:
        if self.current is None or self.current_end_s <= self.current_start_s:
            return self.num_queued_tokens
        left = (self.current_end_s - now_s) / (self.current_end_s - self.current_start_s)
        return self.num_queued_tokens + int(self.current_tokens * max(left, 0.0))

    def store(self, keys: Sequence[bytes], index: GlobalKVIndex) -> None:
        new = []
        for key in keys:
            if key in self.held:
                self.eviction.touch(key)
            else:
                self.held.add(key)
                self.eviction.insert(key, 1)
                new.append(key)
        evicted = []
        while len(self.held) > self.capacity_blocks:
            victim = self.eviction.victim()
            assert victim is not None
            self.held.discard(victim)
            evicted.append(victim)
        index.add(self.worker_id, new)
        if evicted:
            index.remove(self.worker_id, evicted)


class _Decode:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.num_running = 0
        self.num_kv_tokens = 0
        self.num_steps = 0
        self.is_stepping = False
        self.finishing: list[tuple[int, int]] = []  # heap of (step it ends at, request)


class Simulation:
    """One run; `run()` returns its SimResult. Only the event loop writes the workers."""

    def __init__(self, requests: Sequence[TraceRequest], policy: str, config: SimConfig) -> None:
        self.requests = requests
        self.config = config
        self.cost = config.cost
        self.index = GlobalKVIndex()
        capacity = max(config.cache_tokens // config.block_tokens, 1)
        self.prefill = [_Prefill(f"prefill-{n}", capacity, config.eviction) for n in range(config.num_prefill)]
        self.decode = [_Decode(f"decode-{n}") for n in range(config.num_decode)]
        self.prefill_of = {w.worker_id: w for w in self.prefill}
        self.decode_of = {w.worker_id: w for w in self.decode}
        self.routers = [
            Router(policy, self.index, self.cost, f"balancer-{n}", config.decode_binding)
            for n in range(config.num_replicas)
        ]
        self.events: list[tuple[float, int, int, int, object]] = []
        self._seq = 0
        n = len(requests)
        self.ttft_s = [0.0] * n
        self.tpot_s: list[float | None] = [None] * n
        self.first_token_s = [0.0] * n
        self._decode_for: dict[int, str] = {}  # request -> its decode worker ("": late), until it goes there
        self.num_hit_blocks = 0
        self.num_done = 0
        self._eff_area = self._eff_time = 0.0
        self._eff_ratio = 0.0
        self._eff_at = 0.0
        self._last_arrival_s = requests[-1].arrival_s if requests else 0.0
        self.result_series: tuple[list[float], list[list[int]], list[list[int]]] = (
            [],
            [[] for _ in self.prefill],
            [[] for _ in self.decode],
        )

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        for n, request in enumerate(self.requests):
            self._push(request.arrival_s, ARRIVE, n, None)
        for worker_id in self._all_ids():
            self._report(worker_id, 0.0)
        for worker_id, phase in zip(self._all_ids(), self.heartbeat_phases(), strict=True):
            self._push(self.config.heartbeat_s * phase, HEARTBEAT, 0, worker_id)
        handlers = {
            ARRIVE: self._arrive,
            PREFILL_DONE: self._prefill_done,
            DECODE_JOIN: self._decode_join,
            STEP_DONE: self._step_done,
            HEARTBEAT: self._heartbeat,
            PEER: self._peer,
            FINISHED: self._finished_heard,
        }
        while self.events and self.num_done < len(self.requests):
            now_s, _, kind, a, b = heapq.heappop(self.events)
            handlers[kind](now_s, a, b)
        times, waits, kvs = self.result_series
        return SimResult(
            self.ttft_s,
            self.tpot_s,
            self.num_hit_blocks,
            sum(len(r.block_hashes) for r in self.requests),
            [w.busy_s for w in self.prefill],
            self._eff_area / self._eff_time if self._eff_time > 0 else 1.0,
            times,
            waits,
            kvs,
        )

    def heartbeat_phases(self) -> list[float]:
        """Each worker's first heartbeat, in heartbeat intervals: (n + 1) / workers, or drawn from the seed."""
        num_workers = len(self.prefill) + len(self.decode)
        if self.config.seed == 0:
            return [(n + 1) / num_workers for n in range(num_workers)]
        draw = random.Random(self.config.seed)
        return [1.0 - draw.random() for _ in range(num_workers)]  # in (0, 1]

    def _push(self, at_s: float, kind: int, a: int, b: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at_s, self._seq, kind, a, b))

    def _all_ids(self) -> list[str]:
        return [w.worker_id for w in self.prefill] + [w.worker_id for w in self.decode]

    # -- routing ------------------------------------------------------------------------------------------------
    def _arrive(self, now_s: float, n: int, _: object) -> None:
        request = self.requests[n]
        router = self.routers[n % len(self.routers)]
        states = [router.view.report(w.worker_id) for w in self.prefill]
        decode_states = [router.view.report(w.worker_id) for w in self.decode]
        route, assignment = router.route(
            RouteRequest("trace", request.block_hashes, request.num_prompt_tokens, request_id=str(n)),
            [s for s in states if s is not None],
            [s for s in decode_states if s is not None],
            now_s,
        )
        self._share(router, assignment, now_s)
        worker = self.prefill_of[route.prefill_worker_id]
        worker.queue.append(n)
        worker.num_queued_tokens += request.num_prompt_tokens
        self._decode_for[n] = route.decode_worker_id
        if worker.current is None:
            self._start_prefill(worker, now_s)

    def _bind_decode(self, n: int, now_s: float) -> str:
        """Late binding: the decode worker for request n, whose KV is ready now, chosen by the router that routed it."""
        router = self.routers[n % len(self.routers)]
        states = [router.view.report(w.worker_id) for w in self.decode]
        request = RouteRequest("trace", (), self.requests[n].num_prompt_tokens, request_id=str(n))
        decode_id, assignment = router.bind_decode(request, [s for s in states if s is not None], now_s)
        self._share(router, assignment, now_s)
        return decode_id

    def _share(self, router: Router, assignment: Assignment, now_s: float) -> None:
        """The peer replicas hear a decision `share_delay_s` later (never, when `share` is off)."""
        if self.config.share:
            for peer in self.routers:
                if peer is not router:
                    self._push(now_s + self.config.share_delay_s, PEER, 0, (peer, assignment))

    def _peer(self, now_s: float, _: int, payload: object) -> None:
        assert isinstance(payload, tuple)
        peer, assignment = payload
        peer.apply(assignment)

    def _report(self, worker_id: str, now_s: float) -> None:
        state = self._state(worker_id, now_s)
        for router in self.routers:
            router.update(state)

    def _state(self, worker_id: str, now_s: float) -> WorkerState:
        config = self.config
        if worker_id in self.prefill_of:
            p = self.prefill_of[worker_id]
            return WorkerState(
                worker_id,
                now_s,
                config.block_tokens,
                1,
                p.capacity_blocks,
                num_running=int(p.current is not None),
                num_waiting=len(p.queue),
                num_queued_prompt_tokens=p.remaining_tokens(now_s),
                num_cached_blocks=len(p.held),
            )
        d = self.decode_of[worker_id]
        return WorkerState(
            worker_id,
            now_s,
            config.block_tokens,
            config.decode_max_seqs,
            config.decode_kv_tokens // config.block_tokens,
            num_running=d.num_running,
            num_kv_tokens=d.num_kv_tokens,
        )

    def _heartbeat(self, now_s: float, _: int, worker_id: object) -> None:
        assert isinstance(worker_id, str)
        self._report(worker_id, now_s)
        if self.config.record_series and worker_id == self.prefill[0].worker_id:
            self._sample(now_s)
        self._push(now_s + self.config.heartbeat_s, HEARTBEAT, 0, worker_id)

    def _sample(self, now_s: float) -> None:
        times, waits, kvs = self.result_series
        times.append(now_s)
        for n, p in enumerate(self.prefill):
            waits[n].append(p.remaining_tokens(now_s))
        for n, d in enumerate(self.decode):
            kvs[n].append(d.num_kv_tokens)

    # -- prefill ------------------------------------------------------------------------------------------------
    def _start_prefill(self, worker: _Prefill, now_s: float) -> None:
        n = worker.queue.popleft()
        request = self.requests[n]
        worker.num_queued_tokens -= request.num_prompt_tokens
        keys = request.block_hashes
        num_hits = worker.num_leading(keys)
        for key in keys[:num_hits]:
            worker.eviction.touch(key)
        self.num_hit_blocks += num_hits
        cached = min(num_hits * self.config.block_tokens, request.num_prompt_tokens)
        new = request.num_prompt_tokens - cached
        duration = self.cost.prefill_s(cached, new)
        worker.current, worker.current_tokens = n, new
        worker.current_start_s, worker.current_end_s = now_s, now_s + duration
        worker.busy_s += duration
        self._push(now_s + duration, PREFILL_DONE, n, worker.worker_id)

    def _prefill_done(self, now_s: float, n: int, worker_id: object) -> None:
        worker = self.prefill_of[str(worker_id)]
        request = self.requests[n]
        worker.store(request.block_hashes, self.index)
        self.ttft_s[n] = now_s - request.arrival_s
        self.first_token_s[n] = now_s
        worker.current = None
        if worker.queue:
            self._start_prefill(worker, now_s)
        if request.num_output_tokens <= 1:
            self._finish(n, None)
            return
        decode_id = self._decode_for.pop(n) or self._bind_decode(n, now_s)
        self._push(now_s + self.cost.transfer_s(request.num_prompt_tokens), DECODE_JOIN, n, decode_id)

    # -- decode -------------------------------------------------------------------------------------------------
    def _decode_join(self, now_s: float, n: int, worker_id: object) -> None:
        worker = self.decode_of[str(worker_id)]
        request = self.requests[n]
        self._efficiency(now_s)
        worker.num_running += 1
        worker.num_kv_tokens += request.num_prompt_tokens + 1
        ends = worker.num_steps + int(worker.is_stepping) + request.num_output_tokens - 1
        heapq.heappush(worker.finishing, (ends, n))
        self._update_ratio()
        if not worker.is_stepping:
            self._step(worker, now_s)

    def _step(self, worker: _Decode, now_s: float) -> None:
        worker.is_stepping = worker.num_running > 0
        if worker.is_stepping:
            self._push(now_s + self.cost.decode_step_s(worker.num_kv_tokens), STEP_DONE, 0, worker.worker_id)

    def _step_done(self, now_s: float, _: int, worker_id: object) -> None:
        worker = self.decode_of[str(worker_id)]
        self._efficiency(now_s)
        worker.num_steps += 1
        worker.num_kv_tokens += worker.num_running
        while worker.finishing and worker.finishing[0][0] <= worker.num_steps:
            _, n = heapq.heappop(worker.finishing)
            request = self.requests[n]
            worker.num_running -= 1
            worker.num_kv_tokens -= request.num_prompt_tokens + request.num_output_tokens
            self._finish(n, (now_s - self.first_token_s[n]) / (request.num_output_tokens - 1), (worker, now_s))
        self._update_ratio()
        self._step(worker, now_s)

    def _finish(self, n: int, tpot_s: float | None, left: tuple[_Decode, float] | None = None) -> None:
        """Request n is done; `left`: the decode worker it left, and when."""
        self.tpot_s[n] = tpot_s
        self.num_done += 1
        if left is not None and self.config.finish_feed:
            self._push(left[1] + self.config.share_delay_s, FINISHED, n, left)
            return
        for router in self.routers:
            router.observe_output(self.requests[n].num_output_tokens)

    def _finished_heard(self, now_s: float, n: int, left: object) -> None:
        assert isinstance(left, tuple)
        worker, finished_s = left
        request = self.requests[n]
        for router in self.routers:
            router.observe_finished(
                worker.worker_id,
                str(n),
                finished_s,
                request.num_prompt_tokens + request.num_output_tokens,
                request.num_output_tokens,
            )

    def _efficiency(self, now_s: float) -> None:
        """Integrate mean/max KV over decode workers up to now (the ratio holds since the last change), within the
        trace's arrivals: the drain after the last one depends on the trace's end, not on routing."""
        until = min(now_s, self._last_arrival_s)
        if self._eff_ratio > 0 and until > self._eff_at:
            self._eff_area += self._eff_ratio * (until - self._eff_at)
            self._eff_time += until - self._eff_at
        self._eff_at = now_s

    def _update_ratio(self) -> None:
        kvs = [d.num_kv_tokens for d in self.decode]
        top = max(kvs)
        self._eff_ratio = sum(kvs) / len(kvs) / top if top > 0 else 0.0


def simulate(requests: Sequence[TraceRequest], policy: str, config: SimConfig) -> SimResult:
    return Simulation(requests, policy, config).run()
