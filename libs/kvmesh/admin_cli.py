"""`kvmesh admin`: the gateway's admin API (/admin/v1/, services/gateway/tenancy/admin_api.py) from a shell.
Every command prints the JSON the gateway answers on stdout; an error prints the gateway's error body on stderr
and exits 1. The admin key comes from --admin-key or KVMESH_ADMIN_KEY and is never printed.

    kvmesh admin tenants create --name acme --limits '{"tokens_per_minute": 20000}'
    kvmesh admin keys create --tenant ten_... --name ci --models smollm2-135m
    kvmesh admin keys revoke key_...
    kvmesh admin prices set --model smollm2-135m --input 0.15 --cached-input 0.075 --output 0.6
    kvmesh admin usage --tenant ten_... --since 2026-12-01 --format csv     # totals by day and model
    kvmesh admin rollout start --model smollm2-135m --stable 0.1.0 --canary 0.2.0 --steps 5 25 50 100
    kvmesh admin rollout status [ro_...]       # every rollout, or one with its decisions
    kvmesh admin rollout abort ro_...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"
TIMEOUT_S = 30.0


class AdminError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def call(url: str, admin_key: str, method: str, path: str, body: Any = None) -> Any:
    """One admin API call; the answer's JSON, or AdminError with the gateway's error body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {admin_key}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            raw = response.read()
            if response.headers.get_content_type() == "text/csv":  # a usage report's totals: text as it is
                return raw.decode()
            return json.loads(raw)
    except urllib.error.HTTPError as exc:
        raise AdminError(exc.code, exc.read().decode(errors="replace")) from None


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None


def add_parser(commands: Any) -> None:
    admin = commands.add_parser(
        "admin", help="tenants, keys, prices and rollouts through the gateway's admin API (JSON out)"
    )
    admin.add_argument("--url", default=DEFAULT_URL, help=f"the gateway (default {DEFAULT_URL})")
    admin.add_argument("--admin-key", default=None, help="the admin key (default: $KVMESH_ADMIN_KEY)")
    areas = admin.add_subparsers(dest="admin_area", required=True)

    tenants = areas.add_parser("tenants", help="list, show, create and change tenants")
    tenant_commands = tenants.add_subparsers(dest="admin_command", required=True)
    tenant_commands.add_parser("list", help="every tenant")
    tenant_commands.add_parser("get", help="one tenant").add_argument("id")
    for name in ("create", "update"):
        command = tenant_commands.add_parser(name, help=f"{name} a tenant (update: only the options given)")
        if name == "update":
            command.add_argument("id")
        command.add_argument("--name", required=name == "create")
        command.add_argument("--limits", type=_json_arg, help="JSON, e.g. '{\"requests_per_minute\": 60}'")
        command.add_argument("--price-plan")
        command.add_argument("--cache-group", help='tenants of one group may share KV ("" clears it)')

    keys = areas.add_parser("keys", help="list, create and revoke API keys")
    key_commands = keys.add_subparsers(dest="admin_command", required=True)
    key_commands.add_parser("list", help="the keys (never the keys themselves)").add_argument("--tenant")
    create = key_commands.add_parser("create", help="a new key: the only time it is shown")
    create.add_argument("--tenant", required=True, help="the tenant's id (ten_...)")
    create.add_argument("--name", required=True)
    create.add_argument("--models", nargs="+", help="the models it may use (default: every model)")
    create.add_argument("--apis", nargs="+", help="chat.completions completions responses messages grpc (default: all)")
    create.add_argument("--expires-at", help="RFC 3339 with a time zone, e.g. 2027-01-01T00:00:00Z")
    create.add_argument("--limits", type=_json_arg, help="JSON, as for tenants")
    key_commands.add_parser("revoke", help="revoke a key, on every gateway within a second").add_argument("id")

    prices = areas.add_parser("prices", help="the price table (US dollars per million tokens)")
    price_commands = prices.add_subparsers(dest="admin_command", required=True)
    price_commands.add_parser("list", help="every price")
    price = price_commands.add_parser("set", help="set one model's prices in a plan")
    price.add_argument("--plan", default="default")
    price.add_argument("--model", required=True)
    price.add_argument("--input", required=True, help="per million prompt tokens")
    price.add_argument("--cached-input", required=True, help="per million prompt tokens served from cache")
    price.add_argument("--output", required=True, help="per million completion tokens")
    report = areas.add_parser("usage", help="a tenant's usage: totals by day and model, and its records")
    report.add_argument("--tenant", required=True, help="the tenant's id (ten_..., or default)")
    report.add_argument("--since", required=True, help="the first day, YYYY-MM-DD (UTC)")
    report.add_argument("--until", help="the last day, included (default: today)")
    report.add_argument("--format", choices=("json", "csv"), default="json", help="csv: the totals only")
    report.add_argument("--limit", type=int, help="records listed in JSON (default 1000; the totals count all)")

    rollout = areas.add_parser("rollout", help="canary rollouts: start, status, abort")
    rollout_commands = rollout.add_subparsers(dest="admin_command", required=True)
    start = rollout_commands.add_parser("start", help="move a model's traffic to a canary version step by step")
    start.add_argument("--model", required=True)
    start.add_argument("--stable", required=True, help="the version serving now (workers' KVMESH_VERSION)")
    start.add_argument("--canary", required=True, help="the version to roll out")
    start.add_argument("--steps", type=int, nargs="+", help="canary weights in percent, ending at 100 (5 25 50 100)")
    start.add_argument("--check-interval-s", type=float, help="seconds between judgements of a step (60)")
    start.add_argument("--gates", type=_json_arg, help='JSON, e.g. \'{"max_ttft_p95_ratio": 1.2, "min_samples": 100}\'')
    rollout_commands.add_parser("status", help="every rollout, or one with its decisions").add_argument("id", nargs="?")
    rollout_commands.add_parser("abort", help="abort a running rollout: weight 0, the canary drained").add_argument(
        "id"
    )


def _without_none(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


def request_of(args: argparse.Namespace) -> tuple[str, str, Any]:
    """(method, path, body) of an admin command."""
    area = args.admin_area
    if area == "usage":  # no subcommand
        report = {"tenant": args.tenant, "since": args.since, "until": args.until, "format": args.format}
        return "GET", f"/admin/v1/usage?{urllib.parse.urlencode(_without_none(report | {'limit': args.limit}))}", None
    command = args.admin_command
    if area == "tenants":
        fields = (
            _without_none(
                {
                    "name": args.name,
                    "limits": args.limits,
                    "price_plan": args.price_plan,
                    "cache_group": args.cache_group,
                }
            )
            if command in ("create", "update")
            else {}
        )
        return {
            "list": ("GET", "/admin/v1/tenants", None),
            "get": ("GET", f"/admin/v1/tenants/{_quoted(getattr(args, 'id', ''))}", None),
            "create": ("POST", "/admin/v1/tenants", fields),
            "update": ("PATCH", f"/admin/v1/tenants/{_quoted(getattr(args, 'id', ''))}", fields),
        }[command]
    if area == "keys":
        if command == "list":
            query = f"?{urllib.parse.urlencode({'tenant': args.tenant})}" if args.tenant else ""
            return "GET", f"/admin/v1/keys{query}", None
        if command == "revoke":
            return "DELETE", f"/admin/v1/keys/{_quoted(args.id)}", None
        body = {"tenant": args.tenant, "name": args.name, "models": args.models, "apis": args.apis}
        return "POST", "/admin/v1/keys", _without_none({**body, "expires_at": args.expires_at, "limits": args.limits})
    if area == "rollout":
        return _rollout_request(args)
    if command == "list":
        return "GET", "/admin/v1/prices", None
    row = {"plan": args.plan, "model": args.model, "input_per_mtok": args.input}
    row |= {"cached_input_per_mtok": args.cached_input, "output_per_mtok": args.output}
    return "PUT", "/admin/v1/prices", {"prices": [row]}


def _rollout_request(args: argparse.Namespace) -> tuple[str, str, Any]:
    if args.admin_command == "start":
        body = {"model": args.model, "stable_version": args.stable, "canary_version": args.canary}
        extra = {"steps": args.steps, "check_interval_s": args.check_interval_s, "gates": args.gates}
        return "POST", "/admin/v1/rollouts", body | _without_none(extra)
    if args.admin_command == "abort":
        return "POST", f"/admin/v1/rollouts/{_quoted(args.id)}/abort", None
    return "GET", "/admin/v1/rollouts" + (f"/{_quoted(args.id)}" if args.id else ""), None


def _quoted(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def run(args: argparse.Namespace) -> int:
    admin_key = args.admin_key or os.environ.get("KVMESH_ADMIN_KEY", "")
    if not admin_key:
        print("kvmesh admin: no admin key: pass --admin-key or set KVMESH_ADMIN_KEY", file=sys.stderr)
        return 2
    method, path, body = request_of(args)
    try:
        answer = call(args.url, admin_key, method, path, body)
    except AdminError as exc:
        print(exc.body, file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvmesh admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if isinstance(answer, str):  # CSV
        sys.stdout.write(answer)
    else:
        print(json.dumps(answer, indent=2))
    return 0
