"""The HTML report of a result: the summary with its intervals, the gate's table when there was a baseline, and
plots (TTFT and ITL distributions, latency over time, throughput, cache hits, cost), PNGs inlined so the report
is one file that can be attached to a CI run."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from kvmesh.eval.metrics import METRICS, ModelPrice


def write_report(result: dict[str, Any], directory: Path, gate: str = "") -> Path:
    """Write DIRECTORY/index.html (and nothing else); `gate` is the comparison's table, if any."""
    import matplotlib

    matplotlib.use("Agg")
    directory.mkdir(parents=True, exist_ok=True)
    requests = [(i, r) for i, repeat in enumerate(result["repeats"]) for r in repeat["requests"]]
    plots = [_distributions(requests), _over_time(requests), _throughput(result), _cache_hits(requests)]
    prices = {m: ModelPrice(**p) for m, p in result["run"].get("prices", {}).items()}
    if prices:
        plots.append(_cost(requests, prices))
    workload = result["workload"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvmesh eval</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}td,th{padding:2px 8px;text-align:right}"
        "pre{background:#f4f4f4;padding:8px}</style></head><body>",
        f"<h1>kvmesh eval: {html.escape(', '.join(workload['sources']))}</h1>",
        f"<p>{result['created']}; {workload['num_requests']} requests a repeat, {result['run']['repeats']} repeats, "
        f"concurrency {result['run']['concurrency']}; workload {workload['identity'][:12]}; "
        f"{len(workload['skipped'])} lines skipped.</p>",
    ]
    if gate:
        parts.append(f"<h2>Against the baseline</h2><pre>{html.escape(gate)}</pre>")
    parts.append(_summary_table(result))
    parts.append(f"<h2>Mesh</h2><pre>{html.escape(_mesh_text(result['mesh']))}</pre>")
    parts += [f"<img src='data:image/png;base64,{png}' width='1000'>" for png in plots]
    parts.append("</body></html>")
    path = directory / "index.html"
    path.write_text("\n".join(parts))
    return path


def _summary_table(result: dict[str, Any]) -> str:
    rows = ["<h2>Summary (mean of repeats, 95% t-interval)</h2><table><tr><th>metric</th><th>mean</th>"
            "<th>interval</th><th>repeats</th></tr>"]  # fmt: skip
    for name, entry in result["summary"].items():
        values = ", ".join(f"{v:.4g}" for v in entry["values"])
        rows.append(
            f"<tr><td style='text-align:left'>{name} ({METRICS[name].unit})</td><td>{entry['mean']:.4g}</td>"
            f"<td>[{entry['low']:.4g}, {entry['high']:.4g}]</td><td>{values}</td></tr>"
        )
    errors = [f"repeat {i + 1}: {r['metrics']['errors']}" for i, r in enumerate(result["repeats"])]
    return "\n".join(rows) + "</table><p>errors: " + html.escape("; ".join(errors)) + "</p>"


def _mesh_text(mesh: dict[str, Any]) -> str:
    return "\n".join(f"{key}: {value}" for key, value in mesh.items() if key != "prices")


def _png(figure: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=80)
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _distributions(requests: list[tuple[int, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 3.5))
    left.hist([r["ttft_s"] * 1000 for _, r in requests if r["ttft_s"] is not None], bins=40)
    left.set(title="TTFT", xlabel="ms", ylabel="requests")
    right.hist([g * 1000 for _, r in requests for g in r["gaps_s"]], bins=60)
    right.set(title="inter-token latency (every gap)", xlabel="ms", ylabel="gaps")
    return _png(figure)


def _over_time(requests: list[tuple[int, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 3.5))
    for key, marker in (("ttft_s", "o"), ("e2e_s", "x")):
        points = [(r["sent_s"], r[key] * 1000) for _, r in requests if r[key] is not None]
        axes.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, s=12, label=key[:-2].upper())
    axes.set(title="latency over time (all repeats)", xlabel="s from the repeat's start", ylabel="ms")
    axes.legend()
    return _png(figure)


def _throughput(result: dict[str, Any]) -> str:
    """Output tokens per second, each request's tokens counted in the second it ended."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 3.5))
    for index, repeat in enumerate(result["repeats"]):
        per_second: dict[int, int] = {}
        for r in repeat["requests"]:
            if r["e2e_s"] is not None:
                second = int(r["sent_s"] + r["e2e_s"])
                per_second[second] = per_second.get(second, 0) + r["completion_tokens"]
        seconds = range(max(per_second, default=0) + 1)
        axes.plot(list(seconds), [per_second.get(s, 0) for s in seconds], label=f"repeat {index + 1}")
    axes.set(title="output throughput", xlabel="s from the repeat's start", ylabel="tokens/s")
    axes.legend()
    return _png(figure)


def _cache_hits(requests: list[tuple[int, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 3.5))
    points = [(r["sent_s"], r["cached_tokens"] / r["prompt_tokens"]) for _, r in requests if r["prompt_tokens"]]
    axes.scatter([p[0] for p in points], [p[1] for p in points], s=12)
    axes.set(
        title="cached share of each prompt",
        xlabel="s from the repeat's start",
        ylabel="cached / prompt",
        ylim=(0, 1.05),
    )
    return _png(figure)


def _cost(requests: list[tuple[int, dict[str, Any]]], prices: dict[str, ModelPrice]) -> str:
    import matplotlib.pyplot as plt

    from kvmesh.eval.client import RequestOutcome

    figure, axes = plt.subplots(figsize=(12, 3.5))
    repeats = sorted({i for i, _ in requests})
    for index in repeats:
        ended = sorted(
            (r["sent_s"] + r["e2e_s"], prices[r["model"]].cost(RequestOutcome(**r)))
            for i, r in requests
            if i == index and r["e2e_s"] is not None and r["model"] in prices
        )
        total, xs, ys = 0.0, [], []
        for when, cost in ended:
            total += cost
            xs.append(when)
            ys.append(total)
        axes.step(xs, ys, where="post", label=f"repeat {index + 1}")
    axes.set(title="cumulative cost", xlabel="s from the repeat's start", ylabel="$")
    axes.legend()
    return _png(figure)
