"""The `tenant` label of the gateway's metrics: the busiest N tenants by name, the rest `other`."""

from __future__ import annotations

from services.gateway.tenancy.metric_labels import OTHER, UNKNOWN, TenantLabels


def test_the_busiest_tenants_keep_their_names_and_an_overtaker_takes_the_least_busy_ones() -> None:
    evicted: list[str] = []
    labels = TenantLabels(2, evicted.append)
    seen = [labels.label(name) for name in ["a", "a", "a", "a", "b", "b", "c", "d", "d", "d", None]]
    assert seen == ["a", "a", "a", "a", "b", "b", OTHER, OTHER, OTHER, "d", UNKNOWN]  # d's 3rd beats b's 2
    assert labels.named == {"a", "d"} and evicted == ["b"]
    assert [labels.label("b") for _ in range(3)] == [OTHER, "b", "b"]  # b's 3rd ties d's 3: its 4th wins
    assert labels.named == {"a", "b"} and evicted == ["b", "d"] and TenantLabels(0).label("a") == OTHER
