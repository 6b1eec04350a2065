"""Allowances (services/gateway/tenancy/allowance.py and their use in limits.py): room drawn ahead of need is
counted in the store the moment it is drawn, admissions from it write nothing, and what is left goes back, so
the store's counters end equal to what was used, exactly. Pure draws first, then limiters over a real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from kvmesh.nats_server import EmbeddedNats
from services.gateway.errors import GatewayError
from services.gateway.tenancy import allowance as allowances
from services.gateway.tenancy.allowance import Allowance, draw, give_back
from services.gateway.tenancy.limit_counters import Counters, Demand, WindowIds
from services.gateway.tenancy.limits import BUCKET, Limiter, Reservation, entry_name
from services.gateway.tenancy.principal import Limits, Principal

NOW = 1_000_040.0  # 20 s into a minute
IDS = WindowIds.at(NOW)
DEMAND = Demand("r", 12, 32)  # 44 tokens at most


def fresh() -> Counters:
    return Counters(IDS.minute, 0, 0, IDS.day, 0, IDS.month, 0)


# ---- draws, pure ---------------------------------------------------------------------------------------------


def test_a_roomy_scope_lends_room_for_most_requests_counted_as_used() -> None:
    state = fresh()
    limits = Limits(requests_per_minute=10_000, tokens_per_minute=10**7, max_concurrent=1000)
    grant = draw(state, limits, DEMAND, NOW, 30.0, 32, None, "a.x.1.")
    assert grant is not None
    assert (grant.requests, grant.tokens, grant.micros, len(grant.slot_ids)) == (32, 32 * 44, 0, 32)
    assert (state.requests_minute, state.tokens_minute, state.tokens_day, state.tokens_month) == (32, 1408, 1408, 1408)
    assert set(state.slots) == {f"a.x.1.{i}" for i in range(32)} and state.slots["a.x.1.0"] == NOW + 30.0


def test_a_draw_takes_at_most_a_sixteenth_of_what_is_left() -> None:
    state = fresh()
    state.tokens_minute = 1000
    limits = Limits(tokens_per_minute=1000 + 16 * 10 * 44 + 15)  # 7,055 left: a sixteenth is 440, 10 requests
    grant = draw(state, limits, DEMAND, NOW, 30.0, 32)
    assert grant is not None and (grant.requests, grant.tokens) == (32, 440)
    assert state.tokens_minute == 1440


def test_a_tight_limit_lends_nothing_and_is_decided_request_by_request() -> None:
    state = fresh()
    assert draw(state, Limits(tokens_per_minute=2000), DEMAND, NOW, 30.0, 32) is None  # 125 tokens: under 4 x 44
    assert draw(state, Limits(max_concurrent=4), DEMAND, NOW, 30.0, 32) is None
    assert draw(state, Limits(requests_per_minute=63), DEMAND, NOW, 30.0, 32) is None  # 3 requests a sixteenth
    assert draw(state, Limits(), DEMAND, NOW, 30.0, allowances.LEAST - 1) is None  # too small to be worth it
    assert state == fresh()


def test_a_top_up_draws_only_what_the_allowance_lacks() -> None:
    state = fresh()
    limits = Limits(tokens_per_minute=10**7, max_concurrent=1000)
    held = Allowance(limits, IDS)
    first = draw(state, limits, DEMAND, NOW, 30.0, 32, held, "p1.")
    assert first is not None
    held.add(first, NOW)
    for _ in range(20):  # 20 requests admitted, 5 of them still running (their slots lent)
        held.take(44, 0, True, NOW)
    for _ in range(15):
        held.refund(0, 0, held.slot_ids.difference(held.free_slots).pop())
    assert (held.requests, held.tokens, len(held.free_slots), len(held.slot_ids)) == (12, 12 * 44, 27, 32)
    second = draw(state, limits, DEMAND, NOW, 30.0, 32, held, "p2.")
    assert second is not None and (second.requests, second.tokens, second.slot_ids) == (20, 20 * 44, ())
    assert (
        draw(state, limits, DEMAND, NOW, 30.0, 32, Allowance(limits, IDS, 32, 32 * 44, 0, [], set(first.slot_ids)))
        is None
    )


def test_what_goes_back_leaves_only_what_was_used() -> None:
    state = fresh()
    limits = Limits(tokens_per_minute=10**7, max_concurrent=1000)
    grant = draw(state, limits, DEMAND, NOW, 30.0, 32, None, "s.")
    assert grant is not None
    # 3 requests used 30 tokens each (of 44 reserved), one still holds slot s.0; the rest goes back
    give_back(state, IDS, 29, 32 * 44 - 3 * 30, 0, [f"s.{i}" for i in range(1, 32)])
    assert (state.requests_minute, state.tokens_minute, state.tokens_day, list(state.slots)) == (3, 90, 90, ["s.0"])
    later = fresh()
    later.tokens_day = later.tokens_month = 1408
    later_ids = WindowIds.at(NOW + 60)
    rolled = later.rolled(later_ids, NOW + 60)  # the minute it was drawn in has ended: only the day and month
    give_back(rolled, IDS, 32, 1408, 0, [])
    assert (rolled.tokens_minute, rolled.tokens_day, rolled.tokens_month) == (0, 0, 0)


# ---- limiters over a real NATS ------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture(loop_scope="function")
async def nats_url() -> AsyncIterator[str]:
    with EmbeddedNats() as server:
        yield server.url


async def connect(url: str) -> Client:
    return await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2, connect_timeout=2)


async def stored(client: Client, entry: str) -> Counters:
    found = await (await client.jetstream().key_value(BUCKET)).get(entry)
    return Counters.decode(found.value or b"")


def caller(limits: Limits) -> Principal:
    return Principal("ten_t1", "t1", "key_a", "a", key_limits=limits)


ROOMY = Limits(requests_per_minute=10**6, tokens_per_minute=10**9, max_concurrent=10**4)


@pytest.mark.asyncio(loop_scope="function")
async def test_admissions_from_an_allowance_write_nothing_and_the_store_ends_exact(nats_url: str) -> None:
    clock = Clock(NOW)
    client = await connect(nats_url)
    limiter = Limiter(client, clock=clock)
    entry = entry_name("key", "key_a")
    try:
        first = await limiter.reserve(caller(ROOMY), Demand("r0", 12, 32))  # on the store; draws in the background
        await limiter.drain()
        assert (await stored(client, entry)).requests_minute == 1 + 32
        writes = limiter.store_writes
        held = [await limiter.reserve(caller(ROOMY), Demand(f"r{i}", 12, 32)) for i in range(1, 11)]
        assert limiter.store_writes == writes  # ten admissions, no compare-and-set
        assert all(r.holds[0].from_allowance and r.max_tokens == 32 for r in held)
        for reservation in held:
            await limiter.settle(reservation, used_tokens=20)
        assert limiter.store_writes == writes
        await limiter.settle(first, used_tokens=20)
        await limiter.stop()  # what is left of the allowance goes back
        state = await stored(client, entry)
        assert (state.requests_minute, state.tokens_minute, state.tokens_day, state.slots) == (11, 220, 220, {})
    finally:
        await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_three_replicas_with_allowances_never_pass_the_limit_and_account_exactly(nats_url: str) -> None:
    clients = [await connect(nats_url) for _ in range(3)]
    clock = Clock(NOW)  # one minute throughout: a real clock may cross into the next, whose room is new
    limiters = [Limiter(client, clock=clock) for client in clients]
    limit = 64 * 16 * 44  # roomy enough to lend: allowances are drawn until the room runs short
    who = caller(Limits(tokens_per_minute=limit))
    admitted: list[Reservation] = []

    async def one(index: int) -> None:
        try:
            admitted.append(await limiters[index % 3].reserve(who, Demand(f"r{index}", 12, 32)))
        except GatewayError as error:
            assert error.http_status == 429

    try:
        for wave in range(12):  # never settled: every admitted token stays held
            await asyncio.gather(*(one(wave * 200 + i) for i in range(200)))
            for limiter in limiters:
                await limiter.drain()
        tokens = sum(r.demand.tokens(r.max_tokens) for r in admitted)
        held_back = sum(a.tokens for limiter in limiters for a in limiter._allowances.values())
        state = await stored(clients[0], entry_name("key", "key_a"))
        assert any(h.from_allowance for r in admitted for h in r.holds)  # allowances were drawn and used
        assert tokens <= limit  # zero overshoot
        assert state.tokens_minute == tokens + held_back  # the store counts exactly what is admitted or lent
        assert limit - tokens <= 3 * limit // 16  # what the others' allowances may keep from a replica
        for limiter in limiters:
            await limiter.stop()
        assert (await stored(clients[0], entry_name("key", "key_a"))).tokens_minute == tokens
    finally:
        for client in clients:
            await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_an_idle_allowance_goes_back_and_a_new_minute_draws_anew(nats_url: str) -> None:
    clock = Clock(NOW)
    client = await connect(nats_url)
    limiter = Limiter(client, clock=clock)
    limiter.start()
    entry = entry_name("key", "key_a")
    try:
        settled = await limiter.reserve(caller(ROOMY), Demand("r0", 12, 32))
        await limiter.settle(settled, used_tokens=12)
        await limiter.drain()
        running = await limiter.reserve(caller(ROOMY), Demand("r1", 12, 32))  # from the allowance; still running
        assert running.holds[0].from_allowance
        clock.now += allowances.IDLE_S
        await asyncio.sleep(allowances.IDLE_S)  # the keeper looks every IDLE_S / 2
        state = await stored(client, entry)
        assert entry not in limiter._allowances
        assert (state.requests_minute, state.tokens_minute) == (2, 12 + 44)  # r1's slot and tokens stay held
        assert list(state.slots) == [running.holds[0].slot_id]
        clock.now += 60  # r1 ends in the next minute: settled on the store, in the windows it was taken in
        await limiter.settle(running, used_tokens=40)
        state = (await stored(client, entry)).rolled(WindowIds.at(clock.now), clock.now)
        assert (state.tokens_minute, state.tokens_day, state.slots) == (0, 12 + 40, {})
    finally:
        await limiter.stop()
        await client.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_changed_limits_stop_the_old_allowance_at_once(nats_url: str) -> None:
    clock = Clock(NOW)
    client = await connect(nats_url)
    limiter = Limiter(client, clock=clock)
    try:
        await limiter.reserve(caller(ROOMY), Demand("r0", 12, 32))
        await limiter.drain()
        writes = limiter.store_writes
        lowered = Limits(requests_per_minute=3)  # too tight to lend: the roomy allowance goes back at once
        last = await limiter.reserve(caller(lowered), Demand("r1", 12, 32))
        assert not last.holds[0].from_allowance and limiter.store_writes > writes
        await limiter.drain()
        assert not limiter._allowances
        assert (await stored(client, entry_name("key", "key_a"))).requests_minute == 2
        await limiter.reserve(caller(lowered), Demand("r2", 12, 32))
        with pytest.raises(GatewayError) as refused:
            await limiter.reserve(caller(lowered), Demand("r3", 12, 32))
        assert refused.value.http_status == 429
    finally:
        await limiter.stop()
        await client.close()
