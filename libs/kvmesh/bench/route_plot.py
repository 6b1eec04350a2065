"""Plots of `kvmesh bench route --policy all`: the TTFT distribution of every policy (one CDF each), and, per
policy, every worker's load over time (prefill: queued prompt tokens; decode: KV tokens)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_all(by_policy: Mapping[str, Mapping[str, Any]], plot_dir: str, config: Any) -> list[Path]:
    """Writes route_ttft_cdf.png and route_load_<policy>.png; without matplotlib, says so and writes nothing."""
    try:
        import matplotlib
    except ImportError:
        print("kvmesh bench route: no plots (pip install 'kvmesh[bench]' for matplotlib)", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_ttft_cdf(plt, by_policy, out / "route_ttft_cdf.png", config)]
    for policy, run in by_policy.items():
        written.append(_load(plt, policy, run, out / f"route_load_{policy}.png"))
    return written


def _ttft_cdf(plt: Any, by_policy: Mapping[str, Mapping[str, Any]], path: Path, config: Any) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for policy, run in by_policy.items():
        ttfts = sorted(run["ttft_s"])
        shares = [(n + 1) / len(ttfts) for n in range(len(ttfts))]
        axis.plot(ttfts, shares, label=policy)
    axis.axvline(config.ttft_slo_s, color="grey", linestyle=":", label=f"TTFT target {config.ttft_slo_s:g} s")
    axis.set(
        xscale="log",
        xlabel="time to first token (s)",
        ylabel="share of requests",
        title=f"TTFT at load {config.load:g}: {Path(config.trace).name}",
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _load(plt: Any, policy: str, run: Mapping[str, Any], path: Path) -> Path:
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    times = run["series_s"]
    for n, queued in enumerate(run["prefill_queue"]):
        top.plot(times, [tokens / 1e3 for tokens in queued], linewidth=0.7, label=f"prefill-{n}")
    for n, kvs in enumerate(run["decode_kv"]):
        bottom.plot(times, [kv / 1e6 for kv in kvs], linewidth=0.7, label=f"decode-{n}")
    top.set(ylabel="queued prompt tokens (k)", title=f"{policy}: per-worker load")
    bottom.set(ylabel="KV tokens (M)", xlabel="time (s)")
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6, ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
