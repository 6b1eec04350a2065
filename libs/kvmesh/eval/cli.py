"""`kvmesh eval run` and `kvmesh eval compare`: exit 0 when nothing regressed, 1 when something did, 2 on bad
input (a malformed workload under --strict, an unreachable endpoint, a baseline from another workload)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmesh.eval import compare as gate
from kvmesh.eval.metrics import SLO_METRICS
from kvmesh.eval.runner import RunOptions, prices_from, probe, run
from kvmesh.eval.workloads import WorkloadOptions, load

DEFAULT_URL = "http://127.0.0.1:8080"


def add_parser(commands: Any) -> None:
    evaluation = commands.add_parser("eval", help="replay a workload, measure it, gate a change on a baseline")
    eval_commands = evaluation.add_subparsers(dest="eval_command", required=True)
    run_parser = eval_commands.add_parser("run", help="drive an endpoint with a workload; write RESULT.json")
    run_parser.add_argument(
        "--workload", action="append", required=True, metavar="FILE",
        help="a Mooncake trace, a request file or conversations (JSONL), or synthetic:requests=N,input=T,output=T,"
        "spread=F,prefix=F; repeat it to run several together",
    )  # fmt: skip
    run_parser.add_argument("--output", type=Path, required=True, metavar="RESULT.json")
    run_parser.add_argument("--url", default=DEFAULT_URL)
    run_parser.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY", ""), help="default $KVMESH_API_KEY")
    run_parser.add_argument(
        "--admin-key", default=os.environ.get("KVMESH_ADMIN_KEY", ""),
        help="records the workers and reads the prices (default $KVMESH_ADMIN_KEY)",
    )  # fmt: skip
    run_parser.add_argument("--report", type=Path, metavar="DIR", help="write DIR/index.html")
    run_parser.add_argument("--repeats", type=int, default=3)
    run_parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    run_parser.add_argument(
        "--model", default="", help="for traces, conversations, synthetic (default: the first served)"
    )
    run_parser.add_argument("--limit", type=int, help="at most this many sessions of each workload file")
    run_parser.add_argument("--time-scale", type=float, default=1.0, help="trace timestamps multiplied by this")
    run_parser.add_argument("--rate", type=float, help="sessions/s, gamma arrivals instead of the files' times")
    run_parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape with --rate: 1 Poisson")
    run_parser.add_argument("--seed", type=int, default=0)
    run_parser.add_argument("--max-input-tokens", type=int, help="traces and synthetic: prompts cut to this")
    run_parser.add_argument("--max-output-tokens", type=int, help="traces, synthetic, conversations: max_tokens cap")
    run_parser.add_argument("--slo", default="", help="goodput's SLOs per request, e.g. ttft=500ms,tpot=50ms,e2e=5s")
    run_parser.add_argument("--prices", type=Path, help="a price table (JSON) instead of the server's")
    run_parser.add_argument("--price-plan", default="default", help="the server's price plan to read")
    run_parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="recorded setting")
    run_parser.add_argument("--no-salt", action="store_true", help="repeats share KV (no per-repeat cache_salt)")
    run_parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    run_parser.add_argument("--strict", action="store_true", help="a malformed workload line fails the run")
    run_parser.add_argument("--baseline", type=Path, help="gate the result on this earlier result")
    run_parser.add_argument("--max-regression", default=gate.DEFAULT_THRESHOLDS, help="METRIC=N%%|N,...")
    compare_parser = eval_commands.add_parser("compare", help="gate RESULT on BASELINE: exit 0 ok, 1 regressed")
    compare_parser.add_argument("baseline", type=Path)
    compare_parser.add_argument("result", type=Path)
    compare_parser.add_argument("--max-regression", default=gate.DEFAULT_THRESHOLDS, help="METRIC=N%%|N,...")
    compare_parser.add_argument("--json", action="store_true", help="the verdicts as JSON on stdout")


def parse_slo(text: str) -> dict[str, float]:
    """ttft=500ms,tpot=0.05s -> seconds per metric (a bare number is milliseconds)."""
    slo = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in SLO_METRICS:
            raise ValueError(f"--slo: {name!r} is not one of {', '.join(SLO_METRICS)}")
        scale = 1.0 if value.endswith("s") and not value.endswith("ms") else 0.001
        try:
            slo[name] = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"--slo: {name}'s limit {value!r} is not a time like 500ms or 2s") from None
    return slo


def _labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def read_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise gate.CompareError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise gate.CompareError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc
    if not isinstance(data, dict) or data.get("kvmesh_eval") is None:
        raise gate.CompareError(f"{path}: not a `kvmesh eval run` result")
    return data


def _say(text: str) -> None:
    print(f"kvmesh eval: {text}", file=sys.stderr, flush=True)


def _gate(baseline: dict[str, Any], result: dict[str, Any], thresholds: str, as_json: bool = False) -> tuple[int, str]:
    """(exit code, the table); prints the table (or the verdicts as JSON) on stdout."""
    for warning in gate.check_comparable(baseline, result):
        _say(f"warning: {warning}")
    verdicts = gate.compare(baseline, result, gate.parse_thresholds(thresholds))
    table = gate.table(verdicts)
    if as_json:
        print(json.dumps([{**vars(v), "threshold": str(v.threshold)} for v in verdicts]))
    else:
        print(table)
    regressed = [v.metric for v in verdicts if v.is_regressed]
    _say(f"regressed: {', '.join(regressed)}" if regressed else "nothing regressed")
    return gate.exit_code(verdicts), table


def run_command(args: argparse.Namespace) -> int:
    if args.eval_command == "compare":
        return _gate(read_result(args.baseline), read_result(args.result), args.max_regression, args.json)[0]
    gate.parse_thresholds(args.max_regression)  # bad input fails before any request
    baseline = read_result(args.baseline) if args.baseline else None
    options = RunOptions(
        url=args.url.rstrip("/"),
        api_key=args.api_key,
        admin_key=args.admin_key,
        repeats=args.repeats,
        concurrency=args.concurrency,
        request_timeout_s=args.timeout,
        slo=parse_slo(args.slo),
        is_salted=not args.no_salt,
        labels=_labels(args.label),
    )
    mesh = asyncio.run(probe(options))
    served = [m["id"] for m in mesh["models"]]
    workload_options = WorkloadOptions(
        model=args.model or (served[0] if served else ""),
        limit=args.limit,
        time_scale=args.time_scale,
        rate=args.rate,
        burstiness=args.burstiness,
        seed=args.seed,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
        strict=args.strict,
    )
    workload = load(args.workload, workload_options, warn=_say)
    if baseline is not None:
        described = {"identity": workload.identity, "sources": workload.sources, "options": asdict(workload_options)}
        gate.check_same_workload(baseline["workload"], described)
    prices = _prices(args, mesh)
    _say(f"{workload.num_requests} requests in {len(workload.sessions)} sessions, {options.repeats} repeats")
    result = run(workload, workload_options, options, mesh, prices, say=_say)
    args.output.write_text(json.dumps(result, indent=1))
    code, table = gate.EXIT_OK, ""
    if baseline is not None:
        code, table = _gate(baseline, result, args.max_regression)
    if args.report is not None:
        from kvmesh.eval.report import write_report

        _say(f"report: {write_report(result, args.report, table)}")
    return code


def _prices(args: argparse.Namespace, mesh: dict[str, Any]) -> Any:
    if args.prices is not None:
        try:
            return prices_from(json.loads(args.prices.read_text()), args.price_plan)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--prices {args.prices}: cannot read a price table: {exc}") from exc
    if mesh.get("prices"):
        return prices_from(mesh["prices"], args.price_plan)
    return None
