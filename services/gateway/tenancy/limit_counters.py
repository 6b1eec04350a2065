"""The counters behind tenant limits, pure (the clock passed in): the UTC windows (minute, day, month), one
scope's Counters as stored in KVMESH_LIMITS, and the two changes a request makes to them: `admit` reserves (clamping
max_tokens to what is left) and `release` gives back what the request did not use. limits.py stores them."""

from __future__ import annotations

import calendar
import dataclasses
import datetime
import json
import math
from dataclasses import dataclass, field

from services.gateway.errors import ErrorKind
from services.gateway.tenancy.pricing import TokenPrice
from services.gateway.tenancy.principal import Limits
from services.gateway.tenancy.ratelimit_headers import RateLimitFacts

CONCURRENCY_RETRY_S = 1.0  # what a refusal for concurrency tells the client to wait


@dataclass(frozen=True)
class WindowIds:
    minute: int
    day: int
    month: int  # year * 12 + month - 1

    @staticmethod
    def at(now: float) -> WindowIds:
        moment = datetime.datetime.fromtimestamp(now, tz=datetime.UTC)
        return WindowIds(int(now // 60), int(now // 86400), moment.year * 12 + moment.month - 1)


def seconds_to_month_end(now: float) -> float:
    moment = datetime.datetime.fromtimestamp(now, tz=datetime.UTC)
    year, month = divmod(moment.year * 12 + moment.month, 12)  # the next month, 0-based
    return calendar.timegm((year, month + 1, 1, 0, 0, 0)) - now


@dataclass
class Counters:
    """One scope's entry in the store. Changed only by the callbacks a Limiter commits, on a fresh copy."""

    minute: int = 0
    requests_minute: int = 0
    tokens_minute: int = 0
    day: int = 0
    tokens_day: int = 0
    month: int = 0
    tokens_month: int = 0
    slots: dict[str, float] = field(default_factory=dict)  # reservation id -> lease expiry (epoch seconds)
    spend_day: int = 0  # micro-dollars
    spend_month: int = 0

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()  # the fields, flat (asdict is slow)

    @staticmethod
    def decode(data: bytes) -> Counters:
        return Counters(**json.loads(data)) if data else Counters()

    def rolled(self, ids: WindowIds, now: float, *, with_slots: bool = True) -> Counters:
        """A copy in the current windows: a past window's counts drop to 0; expired slots go (all of them when
        not `with_slots`: a copy for its counts alone)."""
        fresh = Counters(ids.minute, 0, 0, ids.day, 0, ids.month, 0)
        if self.minute == ids.minute:
            fresh.requests_minute, fresh.tokens_minute = self.requests_minute, self.tokens_minute
        if self.day == ids.day:
            fresh.tokens_day, fresh.spend_day = self.tokens_day, self.spend_day
        if self.month == ids.month:
            fresh.tokens_month, fresh.spend_month = self.tokens_month, self.spend_month
        if with_slots:
            fresh.slots = {rid: expiry for rid, expiry in self.slots.items() if expiry > now}
        return fresh

    def token_room(self, limits: Limits, now: float) -> tuple[int | None, int | None, float]:
        """(the tightest token limit, what is left of it, seconds until that window resets); (None, None, 0)
        when no token limit is set."""
        candidates = [
            (limit, limit - used, reset)
            for limit, used, reset in (
                (limits.tokens_per_minute, self.tokens_minute, 60 - now % 60),
                (limits.tokens_per_day, self.tokens_day, 86400 - now % 86400),
                (limits.tokens_per_month, self.tokens_month, seconds_to_month_end(now)),
            )
            if limit is not None
        ]
        if not candidates:
            return None, None, 0.0
        limit, left, reset = min(candidates, key=lambda c: c[1])
        return limit, max(0, left), reset

    def spend_room(self, limits: Limits, now: float) -> tuple[int, int, float] | None:
        """(the tightest spend budget, micro-dollars left of it, seconds until it resets); None: no budget."""
        candidates = [
            (limit, max(0, limit - used), reset)
            for limit, used, reset in (
                (limits.spend_per_day_micros, self.spend_day, 86400 - now % 86400),
                (limits.spend_per_month_micros, self.spend_month, seconds_to_month_end(now)),
            )
            if limit is not None
        ]
        return min(candidates, key=lambda c: c[1]) if candidates else None

    def facts(self, limits: Limits, now: float) -> RateLimitFacts:
        limit_tokens, left_tokens, reset_tokens = self.token_room(limits, now)
        rpm = limits.requests_per_minute
        return RateLimitFacts(
            now=now,
            limit_requests=rpm,
            remaining_requests=None if rpm is None else max(0, rpm - self.requests_minute),
            reset_requests_s=None if rpm is None else 60 - now % 60,
            limit_tokens=limit_tokens,
            remaining_tokens=left_tokens,
            reset_tokens_s=None if limit_tokens is None else reset_tokens,
        )


@dataclass(frozen=True)
class Demand:
    """What one request asks for: its prompt once and up to `max_tokens` for each of `n` choices."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    n: int = 1
    model: str = ""
    price: TokenPrice | None = None  # None: spend budgets cannot count this request (no price for its model)

    def tokens(self, max_tokens: int) -> int:
        return self.prompt_tokens + self.n * max_tokens

    def spend(self, limits: Limits, max_tokens: int) -> int:
        """Micro-dollars reserved for `max_tokens` per choice where a spend budget applies (0 elsewhere)."""
        if self.price is None or (limits.spend_per_day_micros is None and limits.spend_per_month_micros is None):
            return 0
        return self.price.most_micros(self.prompt_tokens, self.n * max_tokens)


class Refusal(Exception):
    def __init__(self, kind: ErrorKind, message: str, facts: RateLimitFacts) -> None:
        super().__init__(message)
        self.kind, self.message, self.facts = kind, message, facts


def admit(state: Counters, limits: Limits, demand: Demand, now: float, lease_s: float) -> int:
    """Reserve `demand` in `state` (already rolled to now); the completion ceiling granted per choice, at most
    demand.max_tokens. Raises Refusal when not even one token per choice fits."""
    facts = state.facts(limits, now)
    if limits.requests_per_minute is not None and state.requests_minute >= limits.requests_per_minute:
        retry = dataclasses.replace(facts, retry_after_s=facts.reset_requests_s)
        raise Refusal(ErrorKind.LIMIT_REQUESTS, f"limit of {limits.requests_per_minute} requests per minute", retry)
    if limits.max_concurrent is not None and len(state.slots) >= limits.max_concurrent:
        retry = dataclasses.replace(facts, retry_after_s=CONCURRENCY_RETRY_S)
        raise Refusal(ErrorKind.LIMIT_CONCURRENCY, f"limit of {limits.max_concurrent} concurrent requests", retry)
    granted = demand.max_tokens
    _, left, reset = state.token_room(limits, now)
    if left is not None:
        granted = min(granted, (left - demand.prompt_tokens) // demand.n)
        if granted < 1:
            message = (
                f"limit of {facts.limit_tokens} tokens: {left} left, the request needs at least "
                f"{demand.tokens(1)} ({demand.prompt_tokens} prompt + 1 per choice)"
            )
            raise Refusal(ErrorKind.LIMIT_TOKENS, message, dataclasses.replace(facts, retry_after_s=reset))
    granted = _within_spend(state, limits, demand, granted, now, facts)
    reserved = demand.tokens(granted)
    spend = demand.spend(limits, granted)
    state.spend_day += spend
    state.spend_month += spend
    state.requests_minute += 1
    state.tokens_minute += reserved
    state.tokens_day += reserved
    state.tokens_month += reserved
    if limits.max_concurrent is not None:
        state.slots[demand.request_id] = now + lease_s
    return granted


def _within_spend(
    state: Counters, limits: Limits, demand: Demand, granted: int, now: float, facts: RateLimitFacts
) -> int:
    """`granted` lowered until its most possible cost fits the spend budgets left; Refusal when one token does
    not. A request without a price passes the budgets uncounted."""
    room = state.spend_room(limits, now)
    if room is None or demand.price is None:
        return granted
    limit, left, reset = room
    price = demand.price
    if price.output_per_mtok > 0:  # dollars per million tokens = micro-dollars a token
        prompt_micros = demand.prompt_tokens * price.input_per_mtok
        granted = min(granted, math.floor((left - prompt_micros) / (demand.n * price.output_per_mtok)))
    while granted >= 1 and demand.spend(limits, granted) > left:  # float rounding: at most a step or two
        granted -= 1
    if granted < 1:
        message = f"spend budget of {limit} micro-dollars: {left} left, less than this request's least cost"
        raise Refusal(ErrorKind.LIMIT_SPEND, message, dataclasses.replace(facts, retry_after_s=reset))
    return granted


def release(
    state: Counters, held: ScopeHold, used_tokens: int, used_micros: int = 0, *, uncount_request: bool = False
) -> None:
    """Give back what `held` reserved beyond `used_tokens` (and `used_micros`), in the windows it was reserved in
    (a window that has rolled since no longer counts it), and free its slot."""
    unused = max(0, held.reserved_tokens - used_tokens)
    unused_micros = max(0, held.reserved_micros - used_micros)
    if state.minute == held.windows.minute:
        state.tokens_minute = max(0, state.tokens_minute - unused)
        if uncount_request:
            state.requests_minute = max(0, state.requests_minute - 1)
    if state.day == held.windows.day:
        state.tokens_day = max(0, state.tokens_day - unused)
        state.spend_day = max(0, state.spend_day - unused_micros)
    if state.month == held.windows.month:
        state.tokens_month = max(0, state.tokens_month - unused)
        state.spend_month = max(0, state.spend_month - unused_micros)
    state.slots.pop(held.slot_id or held.request_id, None)


@dataclass(frozen=True)
class ScopeHold:
    """What one request holds in one scope."""

    entry: str  # the store's key: tenant.<id> | key.<id>
    request_id: str
    reserved_tokens: int
    windows: WindowIds
    has_slot: bool
    reserved_micros: int = 0  # spend reserved, where a budget applies
    from_allowance: bool = False  # taken from the limiter's allowance (allowance.py), not from the store
    slot_id: str = ""  # the allowance's slot lent to it; "" when its slot, if any, is keyed by request_id
