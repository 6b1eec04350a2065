"""The `tenant` label of the gateway's metrics, with bounded cardinality: the busiest tenants by name, the rest
`other`.

At most `capacity` tenants are named at a time: the busiest by requests seen here. A tenant outside them that
overtakes the least busy named one takes its place; the one that left is handed to `on_evict`, which removes its
series (telemetry.py), and `other` counts it from then on. So the exported series stay bounded however many
tenants come and go (a removed series is what a scrape sees of a restarted process: rate() copes).
Labels are tenant *names* (the default tenant is `default`), never key ids; requests without an accepted key
are `unknown`. The counts are one per tenant that sent a request, as many as the tenants table holds.

One writer: the RequestRecords of this process, on the event loop, as the Prometheus registry is process-wide.
"""

from __future__ import annotations

from collections.abc import Callable

OTHER = "other"
UNKNOWN = "unknown"  # no accepted key: refused before a tenant was known


class TenantLabels:
    def __init__(self, capacity: int, on_evict: Callable[[str], None] = lambda name: None) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self.on_evict = on_evict
        self._num_requests: dict[str, int] = {}  # tenant name -> requests seen
        self._named: set[str] = set()  # at most `capacity`

    @property
    def named(self) -> frozenset[str]:
        return frozenset(self._named)

    def label(self, tenant_name: str | None) -> str:
        """Count one request of `tenant_name` and return its label."""
        if tenant_name is None:
            return UNKNOWN
        count = self._num_requests.get(tenant_name, 0) + 1
        self._num_requests[tenant_name] = count
        if tenant_name in self._named:
            return tenant_name
        if len(self._named) < self.capacity:
            self._named.add(tenant_name)
            return tenant_name
        if not self._named:
            return OTHER
        least = min(self._named, key=lambda name: (self._num_requests[name], name))
        if count <= self._num_requests[least]:
            return OTHER
        self._named.remove(least)
        self._named.add(tenant_name)
        self.on_evict(least)
        return tenant_name
