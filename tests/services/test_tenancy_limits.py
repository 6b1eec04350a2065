"""Tenant and key limits (services/gateway/tenancy/limits.py): the windows with an injected clock, clamping,
settlement, leases and the fail-closed path, over a real NATS (EmbeddedNats) shared by separate limiters, each
with its own connection, as separate gateway replicas would be. Whole gateways: test_tenancy_limits_gateways.py."""

from __future__ import annotations

import asyncio
import calendar
import hashlib
from collections.abc import AsyncIterator
from decimal import Decimal

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from kvmesh.nats_server import EmbeddedNats
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.tenancy.limit_counters import (
    Counters,
    Demand,
    Refusal,
    ScopeHold,
    WindowIds,
    admit,
    release,
    seconds_to_month_end,
)
from services.gateway.tenancy.limits import Limiter, entry_name
from services.gateway.tenancy.pricing import TokenPrice
from services.gateway.tenancy.principal import Limits, Principal
from services.gateway.tenancy.ratelimit_headers import RateLimitFacts, duration

JAN_31_LAST_SECOND = float(calendar.timegm((2026, 1, 31, 23, 59, 59)))


NO_LIMITS = Limits()


def principal(key_limits: Limits = NO_LIMITS, tenant_limits: Limits = NO_LIMITS, key_id: str = "key_a") -> Principal:
    return Principal("ten_t1", "t1", key_id, "a", tenant_limits=tenant_limits, key_limits=key_limits)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the windows and counters, pure ------------------------------------------------------------------------


def test_window_ids_roll_at_the_minute_the_day_and_the_month() -> None:
    before, after = WindowIds.at(JAN_31_LAST_SECOND), WindowIds.at(JAN_31_LAST_SECOND + 1)
    assert (after.minute - before.minute, after.day - before.day, after.month - before.month) == (1, 1, 1)
    assert before.month == 2026 * 12 + 0 and after.month == 2026 * 12 + 1
    inside = WindowIds.at(JAN_31_LAST_SECOND - 59)  # 23:59:00, the same minute
    assert inside == before
    assert seconds_to_month_end(JAN_31_LAST_SECOND) == 1.0
    assert seconds_to_month_end(float(calendar.timegm((2026, 12, 15, 0, 0, 0)))) == 17 * 86400


def test_counters_roll_only_the_windows_that_ended() -> None:
    now = JAN_31_LAST_SECOND - 120  # 23:57:59
    state = Counters(WindowIds.at(now).minute, 3, 300, WindowIds.at(now).day, 900, WindowIds.at(now).month, 5000)
    state.slots = {"live": now + 10, "dead": now - 1}
    same = state.rolled(WindowIds.at(now + 0.5), now + 0.5)
    assert (same.requests_minute, same.tokens_minute, same.tokens_day, same.tokens_month) == (3, 300, 900, 5000)
    assert same.slots == {"live": now + 10}
    next_minute = state.rolled(WindowIds.at(now + 1), now + 1)  # 23:58:00
    assert (next_minute.requests_minute, next_minute.tokens_minute, next_minute.tokens_day) == (0, 0, 900)
    next_day = state.rolled(WindowIds.at(now + 121), now + 121)  # Feb 1, 00:00:00
    assert (next_day.tokens_minute, next_day.tokens_day, next_day.tokens_month) == (0, 0, 0)


def test_admit_clamps_max_tokens_to_what_is_left_and_reserves_it() -> None:
    now = 1_000_040.0
    ids = WindowIds.at(now)
    state = Counters(ids.minute, 1, 80, ids.day, 80, ids.month, 80)
    granted = admit(state, Limits(tokens_per_minute=100, tokens_per_day=1000), Demand("r1", 10, 32), now, 30.0)
    assert granted == 10  # 100 - 80 - 10 prompt tokens
    assert (state.requests_minute, state.tokens_minute, state.tokens_day, state.tokens_month) == (2, 100, 100, 100)
    assert state.slots == {}  # no concurrency limit: no slot
    two_choices = Counters(ids.minute, 0, 0, ids.day, 0, ids.month, 0)
    assert admit(two_choices, Limits(tokens_per_minute=100), Demand("r2", 21, 64, n=2), now, 30.0) == 39
    assert two_choices.tokens_minute == 21 + 2 * 39


def test_admit_refuses_what_cannot_fit_one_token_with_the_facts() -> None:
    now = 1_000_040.0  # 20 s into a minute
    ids = WindowIds.at(now)
    state = Counters(ids.minute, 4, 90, ids.day, 90, ids.month, 90)
    limits = Limits(requests_per_minute=10, tokens_per_minute=100)
    with pytest.raises(Refusal) as refused:
        admit(state, limits, Demand("r", 10, 32), now, 30.0)
    assert refused.value.kind is ErrorKind.LIMIT_TOKENS
    facts = refused.value.facts
    assert (facts.limit_tokens, facts.remaining_tokens, facts.retry_after_s) == (100, 10, 40.0)
    assert (facts.limit_requests, facts.remaining_requests) == (10, 6)
    assert state.requests_minute == 4 and state.tokens_minute == 90  # a refusal changes nothing
    full = Counters(ids.minute, 10, 0, ids.day, 0, ids.month, 0)
    with pytest.raises(Refusal) as refused:
        admit(full, limits, Demand("r", 1, 1), now, 30.0)
    assert refused.value.kind is ErrorKind.LIMIT_REQUESTS
    busy = Counters(ids.minute, 0, 0, ids.day, 0, ids.month, 0, {"a": now + 5, "b": now + 5})
    with pytest.raises(Refusal) as refused:
        admit(busy, Limits(max_concurrent=2), Demand("r", 1, 1), now, 30.0)
    assert refused.value.kind is ErrorKind.LIMIT_CONCURRENCY and refused.value.facts.retry_after_s == 1.0


def test_release_gives_back_the_unused_part_in_the_windows_still_open() -> None:
    now = 1_000_040.0
    ids = WindowIds.at(now)
    state = Counters(ids.minute, 1, 42, ids.day, 42, ids.month, 42, {"r": now + 30})
    release(state, ScopeHold("key.a", "r", 42, ids, True), used_tokens=15)
    assert (state.tokens_minute, state.tokens_day, state.tokens_month, state.slots) == (15, 15, 15, {})
    later = state.rolled(WindowIds.at(now + 60), now + 60)  # the minute it was reserved in has ended
    release(later, ScopeHold("key.a", "r", 42, ids, True), used_tokens=0)
    assert (later.tokens_minute, later.tokens_day) == (0, 0)  # the day still counted 15 of the 42 reserved
    assert state.requests_minute == 1


def test_headers_in_openai_and_anthropic_shapes() -> None:
    facts = RateLimitFacts(
        now=float(calendar.timegm((2026, 12, 1, 12, 0, 0))),
        limit_requests=60,
        remaining_requests=59,
        reset_requests_s=1.5,
        limit_tokens=2000,
        remaining_tokens=0,
        reset_tokens_s=366.0,
        retry_after_s=0.2,
        max_tokens_clamped=7,
    )
    assert facts.openai_headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1.5s",
        "x-ratelimit-limit-tokens": "2000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6m6s",
        "retry-after": "1",
        "x-kvmesh-max-tokens-clamped": "7",
    }
    anthropic = facts.anthropic_headers()
    assert anthropic["anthropic-ratelimit-tokens-reset"] == "2026-12-01T12:06:06Z"
    assert anthropic["anthropic-ratelimit-requests-remaining"] == "59"
    assert (duration(0.02), duration(59.0), duration(3725.0)) == ("20ms", "59s", "1h2m5s")


def test_entry_names_are_plain_ids_or_hashes() -> None:
    assert entry_name("key", "key_0123abcd") == "key.key_0123abcd"
    hashed = entry_name("tenant", "a b/c")  # KV keys take no spaces or slashes
    assert hashed == "tenant.h" + hashlib.sha256(b"a b/c").hexdigest()[:32]


# ---- limiters over a real NATS ------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="function")
async def nats_url() -> AsyncIterator[str]:
    with EmbeddedNats() as server:
        yield server.url


async def connect(url: str) -> Client:
    return await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2, connect_timeout=2)


@pytest.mark.asyncio(loop_scope="function")
async def test_settlement_releases_the_unused_reservation_for_every_replica(nats_url: str) -> None:
    clock = Clock(1_000_040.0)
    clients = [await connect(nats_url) for _ in range(2)]
    a, b = (Limiter(client, clock=clock) for client in clients)
    caller = principal(Limits(tokens_per_minute=100))
    try:
        held = await a.reserve(caller, Demand("r1", 10, 80))
        assert held.max_tokens == 80 and not held.is_clamped
        assert held.facts is not None and held.facts.remaining_tokens == 10
        clamped = await b.reserve(caller, Demand("r2", 4, 80))  # replica b sees a's 90 tokens
        assert clamped.max_tokens == 6 and clamped.facts is not None and clamped.facts.max_tokens_clamped == 6
        with pytest.raises(GatewayError) as refused:
            await b.reserve(caller, Demand("r3", 1, 1))
        assert refused.value.kind is ErrorKind.LIMIT_TOKENS and refused.value.http_status == 429
        await a.settle(held, used_tokens=10 + 25)  # 55 of the 90 come back
        again = await b.reserve(caller, Demand("r4", 5, 100))
        assert again.max_tokens == 50  # 100 - 35 - 10 - 5
    finally:
        for client in clients:
            await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_key_and_tenant_limits_both_hold_and_a_refusal_takes_nothing(nats_url: str) -> None:
    clock = Clock(1_000_040.0)
    client = await connect(nats_url)
    limiter = Limiter(client, clock=clock)
    first = principal(Limits(tokens_per_minute=1000), Limits(tokens_per_minute=50), key_id="key_1")
    second = principal(Limits(tokens_per_minute=1000), Limits(tokens_per_minute=50), key_id="key_2")
    try:
        assert (await limiter.reserve(first, Demand("r1", 10, 30))).max_tokens == 30
        clamped = await limiter.reserve(second, Demand("r2", 2, 30))  # the tenant's 50 bind, not key_2's 1000
        assert clamped.max_tokens == 8
        with pytest.raises(GatewayError):
            await limiter.reserve(second, Demand("r3", 1, 1))
        await limiter.settle(clamped, used_tokens=0)
        # key_2's own counter went back to 0 after the refusal and the settlement: 1000 - 1 fits its key limit
        assert (await limiter.reserve(second, Demand("r4", 1, 2000))).max_tokens == 9  # the tenant's 10 left - 1
    finally:
        await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_dead_replicas_concurrency_slots_expire_with_their_lease(nats_url: str) -> None:
    clock = Clock(1_000_040.0)
    clients = [await connect(nats_url) for _ in range(2)]
    dead, live = Limiter(clients[0], clock=clock, lease_s=5.0), Limiter(clients[1], clock=clock, lease_s=5.0)
    caller = principal(Limits(max_concurrent=2))
    try:
        await dead.reserve(caller, Demand("d1", 1, 1))
        await dead.reserve(caller, Demand("d2", 1, 1))  # never settled: its gateway "died"
        with pytest.raises(GatewayError) as refused:
            await live.reserve(caller, Demand("l1", 1, 1))
        assert refused.value.kind is ErrorKind.LIMIT_CONCURRENCY
        assert refused.value.http_headers()["retry-after"] == "1"
        clock.now += 5.0  # the leases ran out
        held = await live.reserve(caller, Demand("l2", 1, 1))
        await live.reserve(caller, Demand("l3", 1, 1))
        await live.settle(held, 2)
        await live.reserve(caller, Demand("l4", 1, 1))  # a settled slot is free at once
    finally:
        for client in clients:
            await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_the_counter_store_down_is_a_503_unless_fail_open() -> None:
    server = EmbeddedNats().start()
    client = await connect(server.url)
    closed, open_ = Limiter(client), Limiter(client, fail_open=True)
    caller = principal(Limits(tokens_per_minute=100))
    try:
        assert (await closed.reserve(caller, Demand("r1", 1, 1))).max_tokens == 1
        server.stop()
        with pytest.raises(GatewayError) as refused:
            await closed.reserve(caller, Demand("r2", 1, 1))
        assert refused.value.kind is ErrorKind.UNAVAILABLE and refused.value.http_status == 503
        assert "cannot be reached" in refused.value.message
        passed = await open_.reserve(caller, Demand("r3", 1, 5))
        assert (passed.max_tokens, passed.facts, passed.holds) == (5, None, [])
    finally:
        server.stop()
        await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_three_replicas_admit_exactly_the_limit_under_200_concurrent_requests(nats_url: str) -> None:
    clients = [await connect(nats_url) for _ in range(3)]
    clock = Clock(1_000_040.0)  # one minute throughout: a real clock may cross into the next, whose room is new
    limiters = [Limiter(client, clock=clock) for client in clients]
    caller = principal(Limits(tokens_per_minute=2000))

    async def one(index: int) -> int:
        try:
            reservation = await limiters[index % 3].reserve(caller, Demand(f"r{index}", 12, 32))
        except GatewayError as error:
            assert error.kind is ErrorKind.LIMIT_TOKENS
            return 0
        return reservation.demand.tokens(reservation.max_tokens)

    try:
        admitted = await asyncio.gather(*(one(i) for i in range(200)))
        # 45 whole requests (44 tokens each) use 1980; the 20 left fit one more clamped to 8
        assert sum(admitted) == 2000 and sorted(set(admitted)) == [0, 20, 44]
    finally:
        for client in clients:
            await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_reservation_whose_caller_left_is_released(nats_url: str) -> None:
    client = await connect(nats_url)
    limiter = Limiter(client, clock=Clock(1_000_040.0))
    caller = principal(Limits(tokens_per_minute=100, max_concurrent=1))
    try:
        leaving = asyncio.ensure_future(limiter.reserve(caller, Demand("gone", 10, 90)))
        await asyncio.sleep(0)  # the reservation is under way
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await asyncio.sleep(0.2)  # the store answers; the orphan's release is queued
        await limiter.drain()
        held = await limiter.reserve(caller, Demand("next", 10, 90))
        assert held.max_tokens == 90  # all 100 tokens and the one slot came back
    finally:
        await client.close()


def test_a_spend_budget_clamps_to_what_the_price_allows_and_settles_to_the_real_cost() -> None:
    now = 1_000_040.0
    ids = WindowIds.at(now)
    price = TokenPrice(Decimal(2), Decimal("0.5"), Decimal(10))  # dollars per million tokens: micro-dollars a token
    limits = Limits(spend_per_day_micros=1000)
    state = Counters(ids.minute, 0, 0, ids.day, 0, ids.month, 0)
    demand = Demand("r", 100, 100, price=price)
    assert admit(state, limits, demand, now, 30.0) == 80  # 200 for the prompt + 80 x 10 = 1000
    assert (state.spend_day, state.spend_month) == (1000, 1000)
    with pytest.raises(Refusal) as refused:
        admit(state, limits, Demand("r2", 1, 1, price=price), now, 30.0)
    assert refused.value.kind is ErrorKind.LIMIT_SPEND and refused.value.facts.retry_after_s == 86400 - now % 86400
    used = price.micros(100, 40, 30)  # 60 x 2 + 40 x 0.5 + 30 x 10
    assert used == 440
    release(state, ScopeHold("key.a", "r", 180, ids, False, demand.spend(limits, 80)), 130, used)
    assert (state.spend_day, state.spend_month, state.tokens_day) == (440, 440, 130)
    no_price = Counters(ids.minute, 0, 0, ids.day, 0, ids.month, 0)
    assert admit(no_price, limits, Demand("r3", 100, 100), now, 30.0) == 100  # no price: the budget cannot count it
    assert no_price.spend_day == 0
