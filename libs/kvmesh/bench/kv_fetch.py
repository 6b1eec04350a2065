"""`kvmesh bench kv-fetch`: TTFT of a prefix the KV store holds, by prefix length, when prefill always reads it,
never reads it (computes it again) and decides per request (`KVMESH_KV_FETCH=auto`), side by side in one mesh.

The mesh: four prefill workers, one decode, one KV store node, one balancer routing round-robin. Prefill worker 0
computes each prompt first (cold: nothing cached anywhere) and writes its blocks to the store; once the store
holds them, the same prompt goes three more times, round-robin to workers 1, 2 and 3, set to `always`, `never`
and `auto`: none holds the prompt in its device cache, so each serves it as its mode says, the same prompt within
seconds of the others. Each length comes `repeats` times (a new prompt each time, every length in turn), after one
round that is not counted (the `auto` worker measures its store and its compute there). Reported per length:
the median TTFT of each mode, and `auto`'s against the better of the two fixed modes.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.bench.kv_ttft import API_KEY, long_prompt, scrape_total, stream_chat
from kvmesh.nats_server import free_port
from kvmesh.up import Mesh, MeshPlan

MODES = ("always", "never", "auto")  # prefill workers 1, 2, 3; worker 0 computes every prompt first
BLOCK_TOKENS = 16
SHARED_BLOCKS = 4  # at most this many leading blocks (the chat template's) are shared by every prompt


def _prompt(num_tokens: int, round_index: int) -> str:
    """A prompt of about `num_tokens`, its first block unique to (length, round), so no two share a block."""
    return f"Document {round_index}-{num_tokens}. " + long_prompt(max(num_tokens - 8, 1))


def _store_blocks(mesh: Mesh) -> float:
    return scrape_total(mesh.child("kvcache-0").http_port, 'kvmesh_kvcache_blocks{tier="host"}')


def _wait_stored(mesh: Mesh, num_blocks: float, timeout_s: float = 60.0) -> None:
    """Until the store holds `num_blocks` and has held still for a moment (the prompts share the chat template's
    first blocks, stored once, so the exact count is not known; a round the store had not all of is left out)."""
    deadline = time.monotonic() + timeout_s
    held, still_since = _store_blocks(mesh), time.monotonic()
    while held < num_blocks or time.monotonic() - still_since < 0.3:
        if time.monotonic() > deadline:
            raise TimeoutError("the prompt's blocks did not reach the store")
        time.sleep(0.05)
        now_held = _store_blocks(mesh)
        if now_held != held:
            held, still_since = now_held, time.monotonic()


def _one_round(mesh: Mesh, model: str, prompt: str) -> dict[str, dict[str, Any]]:
    """The prompt cold, then once per mode; the runs by the worker that served them (`cold`: the first)."""
    before = _store_blocks(mesh)
    cold = stream_chat(mesh.base_url, model, prompt)
    _wait_stored(mesh, before + max((cold["prompt_tokens"] - 1) // BLOCK_TOKENS - SHARED_BLOCKS, 1))
    runs = {"cold": cold}
    for _ in MODES:
        run = stream_chat(mesh.base_url, model, prompt)
        runs[run["prefill_worker"]] = run
    return runs


def run_fetch_bench(
    model: str = "smollm2-135m", prefix_tokens: tuple[int, ...] = (32, 128, 512, 2048), repeats: int = 5
) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp(prefix="kvmesh-fetch-")) / "mesh.log"
    plan = MeshPlan(
        prefill=1 + len(MODES),
        decode=1,
        kvcache=1,
        balancer=1,  # one round-robin sequence
        encoder=0,
        models=(model,),
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(API_KEY,),
        env={
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_BALANCER_POLICY": "round_robin",
            "KVMESH_KV_CACHE_MEMORY_BYTES": str(512 * 2**20),
        },
    )
    mode_of = {f"prefill-{n + 1}": mode for n, mode in enumerate(MODES)}
    ttft: dict[int, dict[str, list[float]]] = {n: {mode: [] for mode in MODES} for n in prefix_tokens}
    misrouted = incomplete = 0
    mesh = Mesh(plan, out=log.open("w"))
    try:
        mesh.start()
        for n, mode in enumerate(MODES):  # each worker its mode: spawned again with it
            mesh.kill(f"prefill-{n + 1}")
            mesh.spawn("prefill", n + 1, env={"KVMESH_KV_FETCH": mode})
        mesh.wait_ready(timeout_s=300)
        time.sleep(2.0)  # every worker in the balancer's pool
        for _ in range(1 + len(MODES)):  # the first request of each process
            stream_chat(mesh.base_url, model, "Say hello.")
        for round_index in range(repeats + 1):
            for num_tokens in prefix_tokens:
                runs = _one_round(mesh, model, _prompt(num_tokens, round_index))
                served = {w for w in runs if w != "cold"}
                whole = BLOCK_TOKENS * ((runs["cold"]["prompt_tokens"] - 1) // BLOCK_TOKENS)
                if runs["cold"]["prefill_worker"] != "prefill-0" or served != set(mode_of):
                    misrouted += 1  # the round-robin order slipped: this round says nothing
                    continue
                if runs["prefill-1"]["cached_tokens"] != whole:
                    incomplete += 1  # the store did not hold the whole prefix yet: neither
                    continue
                if round_index > 0:
                    for worker, mode in mode_of.items():
                        ttft[num_tokens][mode].append(runs[worker]["ttft_s"])
        auto_port = mesh.child(f"prefill-{MODES.index('auto') + 1}").http_port
        choices = {
            choice: scrape_total(auto_port, f'kvmesh_prefill_kv_fetch_decisions_total{{choice="{choice}"}}')
            for choice in ("fetch", "partial", "recompute", "probe")
        }
    finally:
        mesh.stop()
    return {
        "model": model,
        "repeats": repeats,
        "by_prefix_tokens": _summary(ttft),
        "auto_choices": choices,  # the auto worker's, warm-up round included
        "misrouted": misrouted,
        "incomplete": incomplete,
        "log": str(log),
    }


def _summary(ttft: dict[int, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    """Per length: each mode's median TTFT (s), and auto's over the better fixed mode's (<= 1: as good)."""
    out: dict[str, dict[str, Any]] = {}
    for num_tokens, by_mode in ttft.items():
        medians = {mode: round(statistics.median(values), 4) if values else None for mode, values in by_mode.items()}
        fixed = [value for mode in ("always", "never") if (value := medians[mode]) is not None]
        best = min(fixed, default=None)
        out[str(num_tokens)] = {
            **{f"ttft_{mode}_s": value for mode, value in medians.items()},
            "auto_over_best": round(medians["auto"] / best, 3) if best and medians["auto"] is not None else None,
            "num_runs": len(by_mode["auto"]),
        }
    return out
