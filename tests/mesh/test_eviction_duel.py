"""The `reuse` policy's duel (mesh.eviction.duel): miniature caches replay the keys under each choice, and the policy
follows the one that hits most. Exact hit counts on small deterministic access patterns, no store."""

from __future__ import annotations

from mesh.eviction.duel import CONFIG_NAMES, DuelingReusePolicy
from mesh.eviction.hint import BlockHint
from mesh.eviction.policies import EvictionPolicy, LRUPolicy, make_policy

HOT = BlockHint(0, 16)  # a long prompt's blocks: this class comes back
SCAN = BlockHint(0, 1)  # one-off lone blocks: this class never does


def k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def hits(policy: EvictionPolicy, accesses: list[tuple[int, BlockHint]], capacity: int) -> int:
    """A cache of `capacity` one-byte blocks under `policy`: how many accesses found their block."""
    held: set[bytes] = set()
    num_hits = 0
    for i, hint in accesses:
        key = k(i)
        if key in held:
            policy.touch(key)
            num_hits += 1
            continue
        policy.insert(key, 1, hint)
        held.add(key)
        while len(held) > capacity:
            victim = policy.victim()
            assert victim is not None
            held.remove(victim)
    return num_hits


def scans_among_a_hot_set(num_rounds: int) -> list[tuple[int, BlockHint]]:
    """48 hot blocks, 8 a round, each round followed by 16 one-off blocks: LRU at 64 blocks keeps none of the hot."""
    accesses = []
    scan = 1000
    for r in range(num_rounds):
        accesses += [((r * 8 + j) % 48, HOT) for j in range(8)]
        accesses += [(scan + j, SCAN) for j in range(16)]
        scan += 16
    return accesses


def test_where_one_off_blocks_flush_lru_the_duel_leaves_lru() -> None:
    accesses = scans_among_a_hot_set(600)
    duel = DuelingReusePolicy(64)
    assert hits(LRUPolicy(), accesses, 64) == 0
    assert hits(make_policy("lfuda", 64), accesses, 64) == 0  # frequency alone does not save the hot set either
    assert hits(duel, accesses, 64) == 3520  # of 4800 hot accesses; a fixed filter+lfuda from the start: 3626
    assert CONFIG_NAMES[duel.followed] == "filter+lfuda"
    assert [round(s.num_hits) for s in duel.shadows] == [0, 0, 50]  # lately, halved every 256 accesses


def test_where_every_choice_hits_alike_it_stays_with_lru() -> None:
    accesses = [(i % 40, HOT) for i in range(4000)]  # 40 blocks in a 64-block cache: every choice hits all
    duel = make_policy("reuse", 64)
    assert isinstance(duel, DuelingReusePolicy)
    assert hits(duel, accesses, 64) == hits(LRUPolicy(), accesses, 64) == 4000 - 40
    assert CONFIG_NAMES[duel.followed] == "lru"


def test_a_shadow_is_followed_only_when_it_leads_by_the_margin() -> None:
    # A 1% margin let late switches to the filter fall below LRU on the synthetic trace at 50% and 75%.
    duel = make_policy("reuse", 64)
    assert isinstance(duel, DuelingReusePolicy)
    duel.insert(b"k", 1, HOT)  # makes the shadows
    for lead, followed in ((104.0, "lru"), (106.0, "filter+lfuda")):
        for shadow, num_hits in zip(duel.shadows, (100.0, 0.0, lead), strict=True):
            shadow.num_hits = num_hits
        duel._choose()  # the choice alone, without replaying enough keys to reach a decision
        assert CONFIG_NAMES[duel.followed] == followed
