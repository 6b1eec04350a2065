"""Allowances: room a limiter draws from a scope's shared counters ahead of need, so that most admissions and
settlements are decided in the gateway's memory instead of by a compare-and-set on the store (a round trip to
NATS each). Pure (the clock passed in); limits.py keeps them.

An allowance is counted in the store as used the moment it is drawn (requests, tokens and spend in the windows
of the minute it was drawn in, and its own concurrency slots), so the sum of every replica's allowances and
reservations never passes a limit: admission from an allowance is as exact as a compare-and-set, only earlier.
What it costs is the other way: room one replica holds is room the others cannot use until it is spent or given
back. So an allowance is small against what is left: at most SHARE of each limited dimension's room, and none at
all unless that is room for LEAST requests like the one asking (a tight limit, such as 2,000 tokens a minute for
44-token requests, is decided request by request on the store, exactly as before). A replica's allowance goes
back to the store when its minute ends, when it has been idle IDLE_S, when the scope's limits change and when the
gateway stops. A gateway that dies holding one leaves it counted: its minute's share rolls away with the minute,
its day's and month's share stays counted (at most one allowance per scope, never more than was admitted), and
its slots expire with their lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.tenancy.limit_counters import Counters, Demand, WindowIds
from services.gateway.tenancy.principal import Limits

SHARE = 16  # an allowance takes at most 1/SHARE of what is left of each limited dimension
LEAST = 4  # and is drawn only when that is room for at least LEAST requests like the one asking
IDLE_S = 2.0  # an allowance unused this long goes back to the store


@dataclass(frozen=True)
class Draw:
    """What one draw took from the store."""

    requests: int
    tokens: int
    micros: int
    slot_ids: tuple[str, ...]


def draw(
    state: Counters,
    limits: Limits,
    demand: Demand,
    now: float,
    lease_s: float,
    most: int,
    held: Allowance | None = None,
    slot_prefix: str = "",
) -> Draw | None:
    """Top the allowance `held` (None: none yet) up to room for `most` requests like `demand`, taking each
    dimension from `state` (rolled to now) and counting it there as used: at most 1/SHARE of what is left of it.
    None when nothing is due: the allowance would not reach LEAST such requests in every limited dimension, or
    it is full. Concurrency slots come back as requests end; requests and tokens do not."""
    tokens_each = demand.tokens(demand.max_tokens)
    micros_each = demand.spend(limits, demand.max_tokens)
    has = held if held is not None else Allowance(limits, WindowIds.at(now))
    requests = most - has.requests
    if limits.requests_per_minute is not None:
        requests = min(requests, (limits.requests_per_minute - state.requests_minute) // SHARE)
    tokens = most * tokens_each - has.tokens
    _, tokens_left, _ = state.token_room(limits, now)
    if tokens_left is not None:
        tokens = min(tokens, tokens_left // SHARE)
    micros = most * micros_each - has.micros
    spend = state.spend_room(limits, now)
    if spend is not None:
        micros = min(micros, spend[1] // SHARE)
    slots = 0
    if limits.max_concurrent is not None:
        slots = min(most - len(has.slot_ids), (limits.max_concurrent - len(state.slots)) // SHARE)
    requests, tokens, micros, slots = max(0, requests), max(0, tokens), max(0, micros), max(0, slots)
    enough = (
        has.requests + requests >= LEAST
        and has.tokens + tokens >= LEAST * tokens_each
        and has.micros + micros >= LEAST * micros_each
        and (limits.max_concurrent is None or len(has.slot_ids) + slots >= LEAST)
    )
    if not enough or requests + tokens + micros + slots == 0:
        return None
    grant = Draw(requests, tokens, micros, tuple(f"{slot_prefix}{i}" for i in range(slots)))
    state.requests_minute += grant.requests
    state.tokens_minute += grant.tokens
    state.tokens_day += grant.tokens
    state.tokens_month += grant.tokens
    state.spend_day += grant.micros
    state.spend_month += grant.micros
    for slot_id in grant.slot_ids:
        state.slots[slot_id] = now + lease_s
    return grant


def give_back(
    state: Counters, windows: WindowIds, requests: int, tokens: int, micros: int, slot_ids: list[str]
) -> None:
    """Return an allowance's unspent part to `state` (rolled to now), in the windows it was drawn in (a window that
    has rolled since no longer counts it), and free its idle slots."""
    if state.minute == windows.minute:
        state.requests_minute = max(0, state.requests_minute - requests)
        state.tokens_minute = max(0, state.tokens_minute - tokens)
    if state.day == windows.day:
        state.tokens_day = max(0, state.tokens_day - tokens)
        state.spend_day = max(0, state.spend_day - micros)
    if state.month == windows.month:
        state.tokens_month = max(0, state.tokens_month - tokens)
        state.spend_month = max(0, state.spend_month - micros)
    for slot_id in slot_ids:
        state.slots.pop(slot_id, None)


@dataclass
class Allowance:
    """One scope's allowance in one limiter: what is left of its draws. Changed only on the event loop."""

    limits: Limits
    windows: WindowIds
    requests: int = 0
    tokens: int = 0
    micros: int = 0
    free_slots: list[str] = field(default_factory=list)
    slot_ids: set[str] = field(default_factory=set)  # every slot it holds in the store, free or lent to a request
    used_at: float = 0.0

    def add(self, grant: Draw, now: float) -> None:
        self.requests += grant.requests
        self.tokens += grant.tokens
        self.micros += grant.micros
        self.free_slots.extend(grant.slot_ids)
        self.slot_ids.update(grant.slot_ids)
        self.used_at = now

    def covers(self, limits: Limits, demand: Demand, micros: int, now: float) -> bool:
        """Whether the whole of `demand` (its full max_tokens: an allowance never clamps) fits in it now."""
        return (
            limits == self.limits
            and int(now // 60) == self.windows.minute
            and self.requests >= 1
            and self.tokens >= demand.tokens(demand.max_tokens)
            and self.micros >= micros
            and (limits.max_concurrent is None or bool(self.free_slots))
        )

    def take(self, tokens: int, micros: int, wants_slot: bool, now: float) -> str:
        """Spend one request's reservation from it; the slot lent to the request ('' when none)."""
        self.requests -= 1
        self.tokens -= tokens
        self.micros -= micros
        self.used_at = now
        return self.free_slots.pop() if wants_slot else ""

    def refund(self, tokens: int, micros: int, slot_id: str, *, request: bool = False) -> None:
        """A request's unused reservation back in (and its slot, and the request itself when it was refused)."""
        self.tokens += tokens
        self.micros += micros
        self.requests += int(request)
        if slot_id:
            self.free_slots.append(slot_id)

    def is_low(self, demand: Demand, micros: int, most: int) -> bool:
        """Under half of `most` requests like `demand` left: time to draw again, before it runs out."""
        half = max(1, most // 2)
        return (
            self.requests < half
            or self.tokens < half * demand.tokens(demand.max_tokens)
            or self.micros < half * micros
            or (self.limits.max_concurrent is not None and len(self.free_slots) < half)
        )
