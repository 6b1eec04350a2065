"""The Grafana dashboard of deploy/grafana/kvmesh.json, written from the panel list below so that a panel is a
line to read, not a screen of JSON: `python -m kvmesh.dashboards` rewrites the file, `--check` says whether it is
current (the suite runs the check, and scrapes a live mesh for every metric a panel names).

Rows follow a request: the gateway (Dynamo's panels: TTFT, inter-token latency, ISL and OSL, requests queued and
running), prefill and decode (prefill p99, queue time, KV in use, transfer bandwidth), the KV cache (hit rate per tier,
bytes moved, protection), the balancer and the experts (decisions, pools against what they would need,
balancedness), then tenancy and security.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvmesh.json"
UID = "kvmesh-overview"
WIDTH = 24  # Grafana's grid


def _quantiles(metric: str, by: str = "model", levels: tuple[float, ...] = (0.5, 0.95, 0.99)) -> tuple[str, ...]:
    return tuple(
        f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[$__rate_interval])))" for q in levels
    )


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[str, ...]
    unit: str = "short"
    legend: tuple[str, ...] = ()  # one per expr; "" lets Grafana name the series
    description: str = ""
    kind: str = "timeseries"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Requests (gateway)",
        (
            Panel(
                "Requests per second by status",
                ("sum by (code) (rate(kvmesh_gateway_requests_total[$__rate_interval]))",),
                "reqps",
                ("{{code}}",),
            ),
            Panel(
                "Error ratio (5xx)",
                (
                    'sum(rate(kvmesh_gateway_requests_total{code=~"5.."}[$__rate_interval]))'
                    " / sum(rate(kvmesh_gateway_requests_total[$__rate_interval]))",
                ),
                "percentunit",
                ("5xx",),
            ),
            Panel(
                "Requests in flight",
                ("sum by (model) (kvmesh_gateway_requests_in_flight)",),
                legend=("{{model}}",),
            ),
            Panel(
                "Time to first token",
                _quantiles("kvmesh_gateway_time_to_first_token_seconds"),
                "s",
                ("p50 {{model}}", "p95 {{model}}", "p99 {{model}}"),
            ),
            Panel(
                "Inter-token latency",
                _quantiles("kvmesh_gateway_inter_token_latency_seconds"),
                "s",
                ("p50 {{model}}", "p95 {{model}}", "p99 {{model}}"),
            ),
            Panel(
                "End-to-end latency",
                _quantiles("kvmesh_gateway_e2e_request_latency_seconds"),
                "s",
                ("p50 {{model}}", "p95 {{model}}", "p99 {{model}}"),
            ),
            Panel(
                "Input and output sequence length (mean tokens per request)",
                (
                    'sum(rate(kvmesh_gateway_tokens_total{kind="prompt"}[$__rate_interval]))'
                    " / sum(rate(kvmesh_gateway_requests_total[$__rate_interval]))",
                    'sum(rate(kvmesh_gateway_tokens_total{kind="completion"}[$__rate_interval]))'
                    " / sum(rate(kvmesh_gateway_requests_total[$__rate_interval]))",
                ),
                legend=("ISL", "OSL"),
            ),
            Panel(
                "Tokens per second",
                ("sum by (kind) (rate(kvmesh_gateway_tokens_total[$__rate_interval]))",),
                legend=("{{kind}}",),
            ),
        ),
    ),
    (
        "Prefill and decode",
        (
            Panel(
                "Prefill time",
                _quantiles("kvmesh_prefill_seconds", levels=(0.5, 0.99)),
                "s",
                ("p50 {{model}}", "p99 {{model}}"),
            ),
            Panel(
                "Queue time (waiting for the prefill engine)",
                _quantiles("kvmesh:request_queue_time_seconds", by="model_name", levels=(0.5, 0.99)),
                "s",
                ("p50 {{model_name}}", "p99 {{model_name}}"),
            ),
            Panel(
                "Decode: requests running",
                ("sum by (model) (kvmesh_decode_running_requests)",),
                legend=("{{model}}",),
            ),
            Panel(
                "Decode: KV in use (tokens)",
                ("sum by (model) (kvmesh_decode_kv_tokens)",),
                legend=("{{model}}",),
            ),
            Panel(
                "KV transfer bandwidth",
                ("sum by (direction) (rate(kvmesh_kv_transfer_bytes_total[$__rate_interval]))",),
                "Bps",
                ("{{direction}}",),
            ),
            Panel(
                "Prompt tokens decode computed itself (should stay 0)",
                ("sum(kvmesh_decode_prompt_tokens_computed)",),
                kind="stat",
            ),
        ),
    ),
    (
        "KV cache",
        (
            Panel(
                "Prompt tokens served from cache, per tier",
                (
                    "sum by (tier) (rate(kvmesh_prefill_cached_tokens_total[$__rate_interval]))"
                    " / ignoring(tier) group_left sum(rate(kvmesh_prefill_prompt_tokens_total[$__rate_interval]))",
                ),
                "percentunit",
                ("{{tier}}",),
            ),
            Panel(
                "Store hits per tier (tokens/s)",
                ("sum by (tier) (rate(kvmesh_kvcache_hit_tokens_total[$__rate_interval]))",),
                legend=("{{tier}}",),
            ),
            Panel("Store bytes per tier", ("sum by (tier) (kvmesh_kvcache_bytes)",), "bytes", ("{{tier}}",)),
            Panel(
                "Evictions by reason",
                ("sum by (reason) (rate(kvmesh_kvcache_evictions_total[$__rate_interval]))",),
                legend=("{{reason}}",),
            ),
            Panel(
                "Blocks under their protection level / repaired fragments",
                (
                    "sum(kvmesh_kvcache_under_protected_blocks)",
                    "sum(rate(kvmesh_kvcache_repaired_fragments_total[$__rate_interval]))",
                ),
                legend=("under-protected", "repaired/s"),
            ),
            Panel("KV index lag", ("max(kvmesh_kv_index_lag_seconds)",), "s", ("lag",)),
        ),
    ),
    (
        "Balancer and experts",
        (
            Panel(
                "Routing decisions by pool and worker",
                ("sum by (pool, worker) (rate(kvmesh_balancer_routes_total[$__rate_interval]))",),
                "reqps",
                ("{{pool}} {{worker}}",),
            ),
            Panel(
                "Workers per pool, live and recommended",
                ("max by (pool) (kvmesh_balancer_workers)", "max by (pool) (kvmesh_balancer_recommended_workers)"),
                legend=("live {{pool}}", "recommended {{pool}}"),
            ),
            Panel(
                "Canary rollouts: weight and decisions",
                (
                    "max by (model) (kvmesh_rollout_canary_weight)",
                    "sum by (model, action) (increase(kvmesh_rollout_decisions_total[$__rate_interval]))",
                ),
                legend=("weight % {{model}}", "{{action}} {{model}}"),
                description="The canary's share of each model's conversations, and the rollout controller's "
                "decisions (hold, step, promote, rollback): docs/operations.md, Canary rollouts.",
            ),
            Panel(
                "Expert balancedness (worst layer)",
                ("min by (model) (kvmesh_expert_balancedness)",),
                "percentunit",
                ("{{model}}",),
                description="Mean / max GPU load of the expert placement, worst MoE layer: 1 is perfectly balanced.",
            ),
            Panel(
                "Expert moves",
                ("sum by (model) (increase(kvmesh_expert_moves_total[$__rate_interval]))",),
                legend=("{{model}}",),
            ),
            Panel(
                "Encoder images per second (cached or not)",
                ("sum by (cached) (rate(kvmesh_encoder_images_total[$__rate_interval]))",),
                legend=("cached={{cached}}",),
            ),
        ),
    ),
    (
        "Tenancy and security",
        (
            Panel(
                "Tokens per second by tenant",
                ("sum by (tenant) (rate(kvmesh_gateway_tokens_total[$__rate_interval]))",),
                legend=("{{tenant}}",),
            ),
            Panel(
                "Usage records: published, written, dropped",
                (
                    "sum(rate(kvmesh_gateway_usage_records_published_total[$__rate_interval]))",
                    "sum(rate(kvmesh_gateway_usage_records_written_total[$__rate_interval]))",
                    "sum(rate(kvmesh_gateway_usage_records_dropped_total[$__rate_interval]))",
                ),
                legend=("published", "written", "dropped"),
            ),
            Panel(
                "Internal calls denied (role not allowed)",
                ("sum by (method, role) (increase(kvmesh_grpc_calls_denied_total[$__rate_interval]))",),
                legend=("{{role}} {{method}}",),
            ),
            Panel(
                "Connections refused at the public port",
                ("sum by (reason) (increase(kvmesh_gateway_connections_refused_total[$__rate_interval]))",),
                legend=("{{reason}}",),
            ),
        ),
    ),
)


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    legends = panel.legend or ("",) * len(panel.exprs)
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": WIDTH // 3, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if panel.kind == "timeseries" else {},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(zip(panel.exprs, legends, strict=True))
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False, "panels": []})
        panels[-1]["gridPos"] = {"h": 1, "w": WIDTH, "x": 0, "y": y}
        y += 1
        for index, panel in enumerate(row):
            x = (index % 3) * (WIDTH // 3)
            panels.append(_panel(panel, len(panels) + 1, x, y + (index // 3) * 8))
        y += ((len(row) + 2) // 3) * 8
    return {
        "uid": UID,
        "title": "kvmesh",
        "description": "One kvmesh mesh: requests, prefill and decode, the KV cache, routing, tenants. "
        "Written by `python -m kvmesh.dashboards`; edit libs/kvmesh/dashboards.py, not this file.",
        "tags": ["kvmesh", "llm-inference"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def expressions() -> list[str]:
    """Every PromQL expression the dashboard holds."""
    return [expr for _, row in ROWS for panel in row for expr in panel.exprs]


def rendered() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when deploy/grafana/kvmesh.json is stale")
    args = parser.parse_args(argv)
    if args.check:
        current = DASHBOARD.read_text() if DASHBOARD.exists() else ""
        if current != rendered():
            print(f"{DASHBOARD} is stale: run python -m kvmesh.dashboards", file=sys.stderr)
            return 1
        return 0
    DASHBOARD.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD.write_text(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main())
