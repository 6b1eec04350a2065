"""Limits per tenant and per key, exact across gateway replicas: admission RESERVES the prompt's tokens plus the
completion ceiling (clamped to what is left) before any work starts, and the request's end SETTLES to the real
usage, releasing the rest. Real usage never exceeds a reservation (the clamped ceiling is max_tokens), so the
sum admitted never passes a limit, whatever the concurrency. The windows and what a request does to them are
limit_counters.py (pure); this module stores them and keeps the reservations.

The counters live in the NATS JetStream KV bucket KVMESH_LIMITS, shared by every replica: one entry per scope
(`tenant.<id>`, `key.<id>`) holds all its windows (requests and tokens this minute, tokens today and this month,
the concurrency slots), updated by compare-and-set; the key's and the tenant's entries are written at once.
Each limiter writes what queues for an entry in one CAS (group commit), starting from its cache of the entry,
which a KV watch keeps at the latest revision every replica wrote; a lost CAS retries from the winner's write as
the watch brings it (reading it when the watch is slower than WATCH_WAIT_S), backing off when lost again.
A refusal decided on the cache is re-checked on a fresh read.

Allowances (allowance.py) keep most requests off the store: where a scope's limits leave room for many requests,
the limiter draws room for up to `allowance_requests` of them in one CAS, counted in the store as used, and admits
and settles from it in memory, drawing again in the background when half is spent. Tight limits draw nothing and
are decided request by request as above.

Concurrency slots are leases: each slot holds an expiry (now + lease_s); the limiter that holds it renews its
slots every lease_s / 3 (one CAS per scope), and any admission drops expired slots. A gateway that dies holding
slots frees them within lease_s. When the store cannot be reached the limiter refuses with 503 (fail closed),
unless `limits_fail_open`, when it admits uncounted and logs a warning. Spend budgets reserve the request's most
possible cost at its model's price (spend.py: PriceBook) and settle to its real cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mesh.bus import jetstream_replicas
from mesh.logging import get_logger
from mesh.tasks import cancel_until_done
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.tenancy import allowance as allowances
from services.gateway.tenancy.allowance import Allowance
from services.gateway.tenancy.limit_counters import (
    Counters,
    Demand,
    Refusal,
    ScopeHold,
    WindowIds,
    admit,
    release,
)
from services.gateway.tenancy.principal import Limits, Principal
from services.gateway.tenancy.ratelimit_headers import RateLimitFacts
from services.gateway.tenancy.spend import PriceBook

log = get_logger(__name__)
R = TypeVar("R")

BUCKET = "KVMESH_LIMITS"
ENTRY_TTL_S = 35 * 86400.0  # an idle scope's entry outlives its longest window (a month), then goes
STORE_TIMEOUT_S = 2.0  # one KV operation; past it the store counts as unreachable
MAX_CAS_ATTEMPTS = 64
CAS_BACKOFF_S = 0.0005  # the most a CAS lost twice or more waits, times the attempts so far (up to 8)
WATCH_WAIT_S = 0.005  # how long a lost CAS waits for the watch to bring the winner's write before reading it
ALLOWANCE_REQUESTS = 32  # the requests an allowance makes room for at first (0: no allowances)
GROWTH = 16  # an allowance that runs short doubles, up to this many times ALLOWANCE_REQUESTS
_KEY_PART = re.compile(r"[A-Za-z0-9_-]{1,64}")


class StoreUnavailable(Exception):
    """The counter store did not answer (NATS down, timeout)."""


class _FailOpen(Exception):
    """Carries the uncounted reservation out of _reserve when limits_fail_open lets a request pass."""

    def __init__(self, reservation: Reservation) -> None:
        super().__init__("admitted uncounted")
        self.reservation = reservation


# ---- reservations ---------------------------------------------------------------------------------------------


@dataclass
class Reservation:
    """An admitted request's holds. `max_tokens` is the ceiling the request runs with; `facts` what the client
    is told. Settled once (Limiter.settle)."""

    demand: Demand
    max_tokens: int
    facts: RateLimitFacts | None  # None: no limit applies
    holds: list[ScopeHold] = field(default_factory=list)
    is_settled: bool = False

    @property
    def is_clamped(self) -> bool:
        return self.max_tokens < self.demand.max_tokens


def entry_name(kind: str, scope_id: str) -> str:
    """A KV key for a scope: the id itself when it is plain, else its SHA-256 (KV keys take few characters)."""
    if _KEY_PART.fullmatch(scope_id):
        return f"{kind}.{scope_id}"
    return f"{kind}.h{hashlib.sha256(scope_id.encode()).hexdigest()[:32]}"


def _has_any(limits: Limits) -> bool:
    return any(
        value is not None
        for value in (
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrent,
            limits.tokens_per_day,
            limits.tokens_per_month,
            limits.spend_per_day_micros,
            limits.spend_per_month_micros,
        )
    )


def _merge(a: RateLimitFacts | None, b: RateLimitFacts) -> RateLimitFacts:
    """The tighter of two scopes' facts, kind by kind."""
    if a is None:
        return b
    requests = min((a, b), key=lambda f: (f.remaining_requests is None, f.remaining_requests or 0))
    tokens = min((a, b), key=lambda f: (f.remaining_tokens is None, f.remaining_tokens or 0))
    return dataclasses.replace(
        requests,
        limit_tokens=tokens.limit_tokens,
        remaining_tokens=tokens.remaining_tokens,
        reset_tokens_s=tokens.reset_tokens_s,
    )


class Limiter:
    """Admission and settlement against the shared counters. `client`: a connected nats.aio.client.Client.
    One per gateway; its cache and renewal set are written only by its own methods."""

    def __init__(
        self,
        client: Any,
        *,
        fail_open: bool = False,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        bucket: str = BUCKET,
        prices: PriceBook | None = None,
        allowance_requests: int = ALLOWANCE_REQUESTS,
    ) -> None:
        self._client = client
        self._fail_open = fail_open
        self._lease_s = lease_s
        self._clock = clock
        self._bucket = bucket
        self._prices = prices  # None: spend budgets count nothing (no prices known)
        self._kv: Any = None
        self._open_lock = asyncio.Lock()
        self._pending: dict[str, list[tuple[Callable[[Counters, float], Any], asyncio.Future[Any]]]] = {}
        self._committers: dict[str, asyncio.Task[None]] = {}  # entry -> the task writing its batches
        self._cache: dict[str, tuple[Counters, int]] = {}  # entry -> (the latest write heard of, revision)
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}  # entry -> lost CASes waiting for the watch
        self._slots: dict[str, set[str]] = {}  # entry -> request ids holding a slot through this limiter
        self._settling: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._watcher: Any = None  # the KV watch that feeds the cache (_follow)
        self._follower: asyncio.Task[None] | None = None
        self._allowance_requests = allowance_requests
        self._allowances: dict[str, Allowance] = {}  # entry -> room drawn ahead of need
        self._drawing: set[str] = set()  # entries with a draw in flight
        self._sizes: dict[str, int] = {}  # entry -> the requests its allowance makes room for, when grown
        self._slot_prefix = f"a.{secrets.token_hex(4)}."  # this limiter's allowance slots in the store
        self._draws = 0
        self._keeper: asyncio.Task[None] | None = None
        self.store_writes = 0  # compare-and-sets sent, lost ones included (what `kvmesh bench admission` reports)
        if fail_open:
            log.warning("limits fail open: when the counter store is unreachable, requests pass uncounted")

    # -- lifecycle --
    def start(self) -> None:
        self._renewer = asyncio.ensure_future(self._renew_forever())
        self._keeper = asyncio.ensure_future(self._keep_allowances())

    async def stop(self) -> None:
        await self.drain()
        await cancel_until_done(self._keeper)
        for entry, allowance in list(self._allowances.items()):
            await self._retire(entry, allowance)
        for task in (self._renewer, self._follower):
            await cancel_until_done(task)
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()

    async def drain(self) -> None:
        """Until every settlement started has been written."""
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    # -- admission --
    async def reserve(self, principal: Principal, demand: Demand) -> Reservation:
        """Hold `demand` against the key's limits and the tenant's. Raises GatewayError: 429 with the facts
        when a limit refuses, 503 when the store is unreachable (fail closed). A caller cancelled meanwhile
        leaves nothing held: what was reserved for it is released when the store answers."""
        if self._prices is not None and demand.model:
            demand = dataclasses.replace(demand, price=self._prices.price(principal.tenant_id, demand.model))
        scopes = [
            (entry, limits)
            for entry, limits in (
                (entry_name("key", principal.key_id), principal.key_limits),
                (entry_name("tenant", principal.tenant_id), principal.tenant_limits),
            )
            if _has_any(limits)
        ]
        if not scopes:
            return Reservation(demand, demand.max_tokens, None)
        ready = self._reserve_from_allowances(scopes, demand)
        if ready is not None:
            return ready
        task = asyncio.ensure_future(self._reserve(scopes, demand))
        try:
            return await asyncio.shield(task)
        except _FailOpen as passed:
            return passed.reservation
        except asyncio.CancelledError:
            task.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, task: asyncio.Future[Reservation]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.settle_soon(task.result(), 0)

    def _reserve_from_allowances(self, scopes: list[tuple[str, Limits]], demand: Demand) -> Reservation | None:
        """The whole reservation from this limiter's allowances, at once and without waiting on anything; None
        when one scope's allowance does not cover it."""
        now = self._clock()
        for entry, limits in scopes:
            allowance = self._allowances.get(entry)
            if allowance is None or not allowance.covers(limits, demand, demand.spend(limits, demand.max_tokens), now):
                return None
        reservation = Reservation(demand, demand.max_tokens, None)
        for entry, limits in scopes:
            held, facts = self._take(entry, limits, demand, now)
            reservation.holds.append(held)
            reservation.facts = _merge(reservation.facts, facts)
        return reservation

    async def _reserve(self, scopes: list[tuple[str, Limits]], demand: Demand) -> Reservation:
        """Both scopes at once (one round trip, not two): each grants what it can; the request runs with the
        smaller grant, and the scope that granted more holds the difference until settlement (never less)."""
        outcomes = await asyncio.gather(
            *(self._hold(entry, limits, demand) for entry, limits in scopes), return_exceptions=True
        )
        reservation = Reservation(demand, demand.max_tokens, None)
        for outcome in outcomes:
            if not isinstance(outcome, BaseException):
                held, granted, facts = outcome
                reservation.holds.append(held)
                reservation.max_tokens = min(reservation.max_tokens, granted)
                reservation.facts = _merge(reservation.facts, facts)
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            with contextlib.suppress(StoreUnavailable):
                await self._release_all(reservation, 0, uncount_request=True)
            raise self._refusal(demand, failures)
        if reservation.is_clamped and reservation.facts is not None:
            reservation.facts = dataclasses.replace(reservation.facts, max_tokens_clamped=reservation.max_tokens)
        return reservation

    def _refusal(self, demand: Demand, failures: list[BaseException]) -> BaseException:
        refusal = next((f for f in failures if isinstance(f, Refusal)), None)
        if refusal is not None:
            return GatewayError(refusal.kind, f"Rate limit reached: {refusal.message}.", rate_limit=refusal.facts)
        unavailable = next((f for f in failures if isinstance(f, StoreUnavailable)), None)
        if unavailable is None:
            return failures[0]
        if self._fail_open:
            log.warning(
                "limits store unreachable; admitting uncounted (limits_fail_open)", error=str(unavailable)[:200]
            )
            return _FailOpen(Reservation(demand, demand.max_tokens, None))
        return GatewayError(
            ErrorKind.UNAVAILABLE,
            "the rate-limit counters (NATS JetStream KV) cannot be reached, so no request is admitted; retry shortly",
        )

    async def _hold(self, entry: str, limits: Limits, demand: Demand) -> tuple[ScopeHold, int, RateLimitFacts]:
        now = self._clock()
        micros = demand.spend(limits, demand.max_tokens)
        allowance = self._allowances.get(entry)
        if allowance is not None and allowance.covers(limits, demand, micros, now):
            held, facts = self._take(entry, limits, demand, now)
            return held, demand.max_tokens, facts
        if allowance is not None and (allowance.limits != limits or allowance.windows.minute != int(now // 60)):
            self._in_background(self._retire(entry, allowance))  # the limits changed, or its minute ended
        elif allowance is not None:  # it ran short: the next draws make room for more
            self._sizes[entry] = min(self._most(entry) * 2, self._allowance_requests * GROWTH)
        held, granted, facts = await self._hold_in_store(entry, limits, demand)
        self._top_up(entry, limits, demand, micros, self._clock())
        return held, granted, self._with_allowance(facts, entry, limits)

    async def _hold_in_store(self, entry: str, limits: Limits, demand: Demand) -> tuple[ScopeHold, int, RateLimitFacts]:
        def apply(state: Counters, now: float) -> tuple[int, RateLimitFacts, WindowIds]:
            granted = admit(state, limits, demand, now, self._lease_s)
            return granted, state.facts(limits, now), WindowIds.at(now)

        granted, facts, windows = await self._transact(entry, apply)
        has_slot = limits.max_concurrent is not None
        if has_slot:
            self._slots.setdefault(entry, set()).add(demand.request_id)
        held = ScopeHold(
            entry, demand.request_id, demand.tokens(granted), windows, has_slot, demand.spend(limits, granted)
        )
        return held, granted, facts

    # -- settlement --
    def settle_soon(self, reservation: Reservation, used_tokens: int, used_micros: int = 0) -> None:
        """Settle in the background (a request ending by cancellation cannot await); `drain` waits for it."""
        if reservation.is_settled:
            return
        reservation.is_settled = True
        rest = self._release_locally(reservation, used_tokens, used_micros)
        if rest:
            self._in_background(self._settle_in_store(reservation.demand.request_id, rest, used_tokens, used_micros))

    async def settle(self, reservation: Reservation, used_tokens: int, used_micros: int = 0) -> None:
        """The request used `used_tokens` (prompt + every choice's completion) costing `used_micros`: release the
        rest, free its slots."""
        if reservation.is_settled:
            return
        reservation.is_settled = True
        rest = self._release_locally(reservation, used_tokens, used_micros)
        if rest:
            await self._settle_in_store(reservation.demand.request_id, rest, used_tokens, used_micros)

    async def _settle_in_store(
        self, request_id: str, holds: list[ScopeHold], used_tokens: int, used_micros: int
    ) -> None:
        try:
            await self._release_in_store(holds, used_tokens, used_micros)
        except StoreUnavailable as exc:  # the minute window rolls anyway; slots expire with their lease
            log.warning("settling a reservation failed", request_id=request_id, error=str(exc)[:200])

    async def _release_all(
        self, reservation: Reservation, used_tokens: int, used_micros: int = 0, *, uncount_request: bool = False
    ) -> None:
        """Every scope at once; StoreUnavailable if any could not be written."""
        rest = self._release_locally(reservation, used_tokens, used_micros, uncount_request)
        await self._release_in_store(rest, used_tokens, used_micros, uncount_request)

    def _release_locally(
        self, reservation: Reservation, used_tokens: int, used_micros: int, uncount_request: bool = False
    ) -> list[ScopeHold]:
        """Give what came from an allowance back to it; the holds left to release in the store."""
        holds, reservation.holds = reservation.holds, []
        return [
            held
            for held in holds
            if not (held.from_allowance and self._refund(held, used_tokens, used_micros, uncount_request))
        ]

    async def _release_in_store(
        self, holds: list[ScopeHold], used_tokens: int, used_micros: int, uncount_request: bool = False
    ) -> None:
        async def give_back(held: ScopeHold) -> None:
            self._slots.get(held.entry, set()).discard(held.slot_id or held.request_id)

            def apply(state: Counters, now: float) -> None:
                release(state, held, used_tokens, used_micros, uncount_request=uncount_request)

            await self._transact(held.entry, apply)

        outcomes = await asyncio.gather(*(give_back(held) for held in holds), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    # -- leases --
    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            for entry, request_ids in list(self._slots.items()):
                if not request_ids:
                    continue

                def renew(state: Counters, now: float, ids: frozenset[str] = frozenset(request_ids)) -> None:
                    for request_id in ids & state.slots.keys():
                        state.slots[request_id] = now + self._lease_s

                try:
                    await self._transact(entry, renew)
                except StoreUnavailable as exc:
                    log.warning("renewing concurrency leases failed", error=str(exc)[:200])

    # -- allowances: room drawn ahead of need (allowance.py) --
    def _take(self, entry: str, limits: Limits, demand: Demand, now: float) -> tuple[ScopeHold, RateLimitFacts]:
        """One scope's hold from its allowance (which covers it)."""
        allowance = self._allowances[entry]
        tokens, micros = demand.tokens(demand.max_tokens), demand.spend(limits, demand.max_tokens)
        slot_id = allowance.take(tokens, micros, limits.max_concurrent is not None, now)
        self._top_up(entry, limits, demand, micros, now)
        held = ScopeHold(entry, demand.request_id, tokens, allowance.windows, bool(slot_id), micros, True, slot_id)
        return held, self._cached_facts(entry, limits, now)

    def _refund(self, held: ScopeHold, used_tokens: int, used_micros: int, uncount_request: bool) -> bool:
        """Give a request's unused reservation back to the allowance of its windows, if this limiter still has
        one (the room is counted in the store for those windows either way); False: settle it in the store."""
        allowance = self._allowances.get(held.entry)
        if allowance is None or allowance.windows != held.windows:
            return False
        unused = max(0, held.reserved_tokens - used_tokens)
        unused_micros = max(0, held.reserved_micros - used_micros)
        allowance.refund(unused, unused_micros, held.slot_id, request=uncount_request)
        if held.slot_id:
            allowance.slot_ids.add(held.slot_id)  # a slot of an allowance given back since: this one keeps it
        return True

    def _most(self, entry: str) -> int:
        return self._sizes.get(entry, self._allowance_requests)

    def _top_up(self, entry: str, limits: Limits, demand: Demand, micros: int, now: float) -> None:
        """Draw for `entry` in the background when its allowance is missing, stale or half spent, and the cached
        counters say a draw would get something (a tight limit costs no extra write)."""
        if self._allowance_requests < allowances.LEAST or entry in self._drawing:
            return
        current = self._allowances.get(entry)
        is_current = current is not None and current.limits == limits and current.windows.minute == int(now // 60)
        if current is not None and is_current and not current.is_low(demand, micros, self._most(entry)):
            return
        cached = self._cache.get(entry)
        if cached is None:
            return
        trial = cached[0].rolled(WindowIds.at(now), now)
        held = current if is_current else None
        if allowances.draw(trial, limits, demand, now, self._lease_s, self._most(entry), held) is None:
            return
        self._drawing.add(entry)
        self._in_background(self._draw(entry, limits, demand))

    async def _draw(self, entry: str, limits: Limits, demand: Demand) -> None:
        self._draws += 1
        prefix = f"{self._slot_prefix}{self._draws}."

        def apply(state: Counters, now: float) -> tuple[allowances.Draw | None, WindowIds, float]:
            held = self._allowances.get(entry)
            if held is not None and (held.limits != limits or held.windows != WindowIds.at(now)):
                held = None
            grant = allowances.draw(state, limits, demand, now, self._lease_s, self._most(entry), held, prefix)
            return grant, WindowIds.at(now), now

        try:
            grant, windows, now = await self._transact(entry, apply)
        except StoreUnavailable as exc:
            log.warning("drawing an allowance failed", error=str(exc)[:200])
            return
        finally:
            self._drawing.discard(entry)
        if grant is None:
            return
        self._slots.setdefault(entry, set()).update(grant.slot_ids)
        current = self._allowances.get(entry)
        if current is None or current.limits != limits or current.windows != windows:
            if current is not None:
                self._in_background(self._retire(entry, current))
            current = self._allowances[entry] = Allowance(limits, windows)
        current.add(grant, now)

    def _retire(self, entry: str, allowance: Allowance) -> Awaitable[None]:
        """Take `allowance` out of use now and queue what is left of it to go back to the store, ahead of anything
        queued later (a request on the store next sees the room returned); await the result to know it is written.
        Its slots lent to running requests stay theirs: they are freed as those settle."""
        if self._allowances.get(entry) is allowance:
            del self._allowances[entry]
        free_slots, allowance.free_slots = allowance.free_slots, []
        requests, tokens, micros = allowance.requests, allowance.tokens, allowance.micros
        allowance.requests = allowance.tokens = allowance.micros = 0
        self._slots.get(entry, set()).difference_update(free_slots)

        def apply(state: Counters, now: float) -> None:
            allowances.give_back(state, allowance.windows, requests, tokens, micros, free_slots)

        return self._written_back(self._enqueue(entry, apply))

    async def _written_back(self, written: asyncio.Future[None]) -> None:
        try:
            await written
        except StoreUnavailable as exc:  # it stays counted: the minute's part rolls away, slots expire
            log.warning("giving an allowance back failed", error=str(exc)[:200])

    def _in_background(self, work: Awaitable[None]) -> None:
        """A store write no caller waits for; `drain` does."""
        task = asyncio.ensure_future(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _keep_allowances(self) -> None:
        """Allowances go back when idle IDLE_S or when their minute has ended."""
        while True:
            await asyncio.sleep(allowances.IDLE_S / 2)
            now = self._clock()
            for entry, allowance in list(self._allowances.items()):
                if now - allowance.used_at >= allowances.IDLE_S:
                    self._sizes.pop(entry, None)
                    await self._retire(entry, allowance)
                elif allowance.windows != WindowIds.at(now):
                    await self._retire(entry, allowance)

    def _cached_facts(self, entry: str, limits: Limits, now: float) -> RateLimitFacts:
        cached = self._cache.get(entry)
        state = cached[0].rolled(WindowIds.at(now), now, with_slots=False) if cached is not None else Counters()
        return self._with_allowance(state.facts(limits, now), entry, limits)

    def _with_allowance(self, facts: RateLimitFacts, entry: str, limits: Limits) -> RateLimitFacts:
        """What is left for this replica: the store counts its allowance as used, but the allowance is its own."""
        allowance = self._allowances.get(entry)
        if allowance is None or allowance.windows.minute != int(facts.now // 60):
            return facts
        requests, tokens = facts.remaining_requests, facts.remaining_tokens
        if requests is not None and facts.limit_requests is not None:
            requests = min(facts.limit_requests, requests + allowance.requests)
        if tokens is not None and facts.limit_tokens is not None:
            tokens = min(facts.limit_tokens, tokens + allowance.tokens)
        return dataclasses.replace(facts, remaining_requests=requests, remaining_tokens=tokens)

    # -- the store: one writer per entry in this limiter, batching what queues behind it --
    async def _transact(self, entry: str, apply: Callable[[Counters, float], R]) -> R:
        """Apply `apply` to the entry (rolled to now) and compare-and-set it. While one CAS on an entry is in
        flight, what arrives for it queues and goes in the next CAS together, each applied in order: one round
        trip for a batch, so the rate grows with the load instead of queueing one round trip per request."""
        result: R = await self._enqueue(entry, apply)
        return result

    def _enqueue(self, entry: str, apply: Callable[[Counters, float], Any]) -> asyncio.Future[Any]:
        """Queue `apply` for the entry's next CAS, now (before anything queued after this call)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(entry, []).append((apply, future))
        if entry not in self._committers:
            self._committers[entry] = asyncio.ensure_future(self._commit_all(entry))
        return future

    async def _commit_all(self, entry: str) -> None:
        try:
            while self._pending.get(entry):
                batch = self._pending.pop(entry)
                try:
                    outcomes = await self._commit(entry, [apply for apply, _ in batch])
                except StoreUnavailable as exc:
                    outcomes = [exc] * len(batch)
                except Exception as exc:  # never leave a caller waiting
                    outcomes = [StoreUnavailable(f"{type(exc).__name__}: {exc}")] * len(batch)
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if future.done():
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        finally:
            del self._committers[entry]

    async def _commit(self, entry: str, applies: list[Callable[[Counters, float], Any]]) -> list[Any]:
        """One batch: each apply's result, or its Refusal. A refusal decided on what this limiter last wrote is
        re-decided on a fresh read; a lost CAS re-reads and re-applies the whole batch."""
        from nats.js.errors import KeyWrongLastSequenceError

        cached = self._cache.get(entry)
        for attempt in range(MAX_CAS_ATTEMPTS):
            is_fresh = cached is None
            state, revision = cached if cached is not None else await self._read(entry)
            now = self._clock()
            state = state.rolled(WindowIds.at(now), now)
            outcomes: list[Any] = []
            for apply in applies:
                try:
                    outcomes.append(apply(state, now))
                except Refusal as refusal:  # admit() refuses before changing anything
                    outcomes.append(refusal)
            if not is_fresh and any(isinstance(outcome, Refusal) for outcome in outcomes):
                cached = None
                continue
            try:
                self.store_writes += 1
                revision = await self._io(self._kv.update(entry, state.encode(), last=revision))
            except KeyWrongLastSequenceError:  # another replica wrote: start from its write, as the watch brings it
                if attempt:  # lost again: back off a little (no livelock)
                    await asyncio.sleep(random.uniform(0, CAS_BACKOFF_S * min(attempt, 8)))
                cached = await self._past(entry, revision)  # None: not heard in time, read it
                continue
            self._remember(entry, state, revision)
            return outcomes
        raise StoreUnavailable(f"{MAX_CAS_ATTEMPTS} compare-and-set attempts lost on {entry}")

    def _remember(self, entry: str, state: Counters, revision: int) -> None:
        cached = self._cache.get(entry)
        if cached is None or revision > cached[1]:
            self._cache[entry] = (state, revision)
            for waiter in self._waiters.pop(entry, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def _past(self, entry: str, revision: int) -> tuple[Counters, int] | None:
        """The cached entry once the watch brought a revision past `revision` (a lost CAS: another replica's
        write is on its way), or None after WATCH_WAIT_S: one round trip saved on each lost CAS."""
        cached = self._cache.get(entry)
        if cached is None or cached[1] <= revision:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(entry, []).append(waiter)
            await asyncio.wait({waiter}, timeout=WATCH_WAIT_S)
            if not waiter.done():
                waiter.cancel()
            cached = self._cache.get(entry)
        return cached if cached is not None and cached[1] > revision else None

    async def _follow(self, watcher: Any) -> None:
        """Every replica's writes, as they happen, into the cache: the next CAS starts from the latest revision
        and seldom loses. Only a speed-up: a stale cache costs a lost CAS and a read, never a wrong count."""
        from nats.errors import TimeoutError as NatsTimeout

        try:
            while True:  # stop() ends it with mesh.tasks.cancel_until_done: watcher.updates may swallow one cancel
                try:
                    update = await watcher.updates(timeout=3600)
                except NatsTimeout:
                    continue
                if update is not None and update.value:
                    self._remember(update.key, Counters.decode(update.value), update.revision)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("following the limit counters stopped", error=str(exc)[:200])

    async def _read(self, entry: str) -> tuple[Counters, int]:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        await self._open()
        try:
            found = await self._io(self._kv.get(entry))
        except KeyNotFoundError:
            return Counters(), 0
        except KeyDeletedError as exc:
            return Counters(), exc.entry.revision if exc.entry is not None else 0
        return Counters.decode(found.value or b""), found.revision

    async def _open(self) -> None:
        if self._kv is not None:
            return
        from nats.js.api import KeyValueConfig
        from nats.js.errors import BucketNotFoundError

        async with self._open_lock:
            if self._kv is not None:
                return
            js = self._client.jetstream(timeout=STORE_TIMEOUT_S)
            try:
                kv = await self._io(js.key_value(self._bucket))
            except BucketNotFoundError:
                config = KeyValueConfig(bucket=self._bucket, history=1, ttl=ENTRY_TTL_S, replicas=jetstream_replicas())
                kv = await self._io(js.create_key_value(config))
            self._watcher = await self._io(kv.watchall())
            self._follower = asyncio.ensure_future(self._follow(self._watcher))
            self._kv = kv

    async def _io(self, call: Any) -> Any:
        """One store call; what is not an answer (timeout, closed connection, no responders) is StoreUnavailable."""
        from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

        try:
            return await call  # bounded by the JetStream context's timeout (STORE_TIMEOUT_S)
        except (KeyWrongLastSequenceError, KeyNotFoundError, KeyDeletedError, BucketNotFoundError):
            raise
        except Exception as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
