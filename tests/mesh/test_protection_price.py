"""Protection priced by recompute cost: the settings' checks, the budgeted assignment and the repair order, with
exact values; and the bench's loss arithmetic on a trace small enough to work out by hand."""

from __future__ import annotations

import pytest

from kvmesh.bench.kv_protection import lost_seconds, reuse_rates
from mesh.erasure import Protection
from mesh.protection_price import PricedProtection, ReuseBook, assign, parse_levels, recompute_price, repair_rank
from mesh.routing.cost import CostModel

P = Protection.parse


def test_levels_sort_cheapest_first_and_bad_settings_name_themselves() -> None:
    assert parse_levels("1+2, 1+0,4+1,4+1") == (P("1+0"), P("4+1"), P("1+2"))
    with pytest.raises(ValueError, match=r"KVMESH_KV_PROTECTION_LEVELS='2\+x'"):
        PricedProtection.parse("2+x", 2.0)
    with pytest.raises(ValueError, match=r"KVMESH_KV_PROTECTION_LEVELS=' , '"):
        PricedProtection.parse(" , ", 2.0)
    with pytest.raises(ValueError, match=r"KVMESH_KV_PROTECTION_BUDGET=1.2: cannot hold the 5 fragments of the "):
        PricedProtection.parse("4+1,1+1", 1.2)  # the cheapest level needs 1.25 bytes per block byte
    with pytest.raises(ValueError, match="needs 5 store nodes, there are 4"):
        PricedProtection.parse("4+1", 2.0, num_nodes=4)


def test_one_level_for_all_is_the_most_protective_the_budget_holds() -> None:
    assert PricedProtection.parse("1+0,4+1,1+1,1+2", 2.0).uniform() == P("4+1")  # 1+1 survives no more
    assert PricedProtection.parse("1+0,4+1,1+1,1+2", 3.0).uniform() == P("1+2")
    assert PricedProtection.parse("1+0,4+1", 1.1).uniform() == P("1+0")


def test_the_budget_buys_one_loss_for_the_dearest_blocks_first_then_two() -> None:
    # 4 blocks of 1 byte; 4+1 costs 0.25 more than 1+0, 1+2 another 1.75
    plan = PricedProtection.parse("1+0,4+1,1+1,1+2", 1.5)  # 2 spare: 4+1 for all, 1 left buys no 1+2
    assert assign([1.0, 5.0, 3.0, 0.0], plan) == [P("4+1")] * 4
    tight = PricedProtection.parse("1+0,4+1,1+2", 1.1)  # 0.4 spare: 4+1 for the dearest only
    assert assign([1.0, 5.0, 3.0, 0.0], tight) == [P("1+0"), P("4+1"), P("1+0"), P("1+0")]
    rich = PricedProtection.parse("1+0,4+1,1+2", 2.0)  # 4 spare: 4+1 for all (1), 1+2 for the dearest (1.75)
    assert assign([1.0, 5.0, 3.0, 0.0], rich) == [P("4+1"), P("1+2"), P("4+1"), P("4+1")]


def test_a_price_is_reuse_times_the_prefill_seconds_of_the_tokens() -> None:
    cost = CostModel()
    seconds = 512 / cost.prefill_tokens_per_s * (1 + (1024 + 256) / cost.attention_knee_tokens)
    assert recompute_price(512, 1024, 0.5, cost) == pytest.approx(0.5 * seconds)
    assert recompute_price(512, 1024, 0.0, cost) == 0.0


def test_repair_takes_more_parity_first() -> None:
    levels = [P("1+0"), P("4+1"), P("1+2"), P("1+1")]
    assert sorted(levels, key=repair_rank) == [P("1+2"), P("1+1"), P("4+1"), P("1+0")]


def test_a_lost_head_costs_the_chain_below_it_once() -> None:
    cost = CostModel()
    after = [(0.0, [1, 2, 3]), (1.0, [1, 2, 3, 4])]
    # 2 is lost: the first request recomputes 2 and 3 after 1 (and puts them back); the second loses nothing
    expected = cost.prefill_s(512, 1024) - cost.prefill_overhead_s
    assert lost_seconds(after, held={1, 2, 3}, lost={2}, cost=cost) == pytest.approx(expected)
    assert lost_seconds(after, held={1, 2, 3}, lost=set(), cost=cost) == 0.0


def test_reuse_rates_by_uses_so_far() -> None:
    # 1 used three times, 2 twice, 3 once: of 3 blocks used once 2 came back; of 2 used twice, 1
    rates = reuse_rates([(0.0, [1, 2]), (1.0, [1, 2, 3]), (2.0, [1])])
    assert rates[1] == pytest.approx(2 / 3)
    assert rates[2] == pytest.approx(1 / 2)


def test_the_writer_prices_a_block_by_its_depth_its_chain_and_its_uses() -> None:
    cost = CostModel()
    book = ReuseBook(cost, max_keys=4)
    book.note_prompt([b"a", b"b", b"c"])
    book.note_prompt([b"a", b"x"])  # `a` used twice; one key of two used once was used again
    assert book.reuse_likelihood(1) == (1 + 1) / (4 + 2)  # 4 keys reached 1 use, 1 of them 2
    assert book.reuse_likelihood(2) == (0 + 1) / (1 + 2)
    # `b`: 2 blocks (itself and `c` below it) after 16 tokens, used once
    assert book.price(b"b", 16) == recompute_price(32, 16, book.reuse_likelihood(1), cost)
    assert book.price(b"a", 16) == recompute_price(48, 0, book.reuse_likelihood(2), cost)  # the longest chain
    assert book.price(b"a", 16) > book.price(b"b", 16) > book.price(b"c", 16)
    book.note_prompt([b"y"])  # a fifth key: the one noted longest ago (`b`) is forgotten, priced as a lone block
    assert book.price(b"b", 16) == recompute_price(16, 0, book.reuse_likelihood(1), cost)


def test_prefill_refuses_a_budget_below_its_cheapest_level_naming_the_setting() -> None:
    from mesh.config import SettingError, load_settings
    from services.prefill.config import PrefillSettings

    env = {"KVMESH_KV_PROTECTION_LEVELS": "1+1,1+2", "KVMESH_KV_PROTECTION_BUDGET": "1.5"}
    with pytest.raises(SettingError, match=r"KVMESH_KV_PROTECTION_BUDGET=1.5: cannot hold the 2 fragments of the "):
        load_settings(PrefillSettings, env=env)
    with pytest.raises(SettingError, match=r"KVMESH_KV_PROTECTION_LEVELS='1\+x'"):
        load_settings(PrefillSettings, env={"KVMESH_KV_PROTECTION_LEVELS": "1+x"})
    assert load_settings(PrefillSettings, env={}).priced_protection() is None  # one level for all
    plan = load_settings(PrefillSettings, env={**env, "KVMESH_KV_PROTECTION_BUDGET": "2.5"}).priced_protection()
    assert plan == PricedProtection((P("1+1"), P("1+2")), 2.5)
