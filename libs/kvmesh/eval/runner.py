"""The sessions at their arrival times, `repeats` times over, against one endpoint; and what the endpoint says
about itself (models, workers, prices), so that a comparison of unlike setups can say so.

Each session starts at its arrival time; a conversation's next turn goes when the last one ends, with the history
(the recorded reply, else the model's own). `concurrency` bounds the requests in flight; the wait for a slot is
the request's queueing time. Each repeat salts its prompts' KV (`cache_salt`, Chat Completions and Responses)
so a repeat finds none of the previous repeat's blocks, only its own reuse, unless `is_salted` is off.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.metadata
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvmesh.eval.client import RequestOutcome, send, streamed_body
from kvmesh.eval.metrics import ModelPrice, repeat_metrics, summarize
from kvmesh.eval.quality import judge
from kvmesh.eval.workloads import EvalWorkload, Session, WorkloadOptions

RESULT_VERSION = 1
PROBE_TIMEOUT_S = 5.0


class EndpointError(ValueError):
    """The endpoint cannot be used: unreachable, or it refused the key."""


@dataclass(frozen=True)
class RunOptions:
    url: str
    api_key: str
    admin_key: str = ""  # reads the workers (/v1/mesh/workers) and prices (/admin/v1/prices) when given
    repeats: int = 3
    concurrency: int = 16  # requests in flight at most
    request_timeout_s: float = 600.0
    slo: dict[str, float] = field(default_factory=dict)  # seconds, per SLO_METRICS name
    is_salted: bool = True  # a cache_salt of its own per repeat
    labels: dict[str, str] = field(default_factory=dict)  # settings the caller records with the result

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, not {self.repeats}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, not {self.concurrency}")


async def _get(http: aiohttp.ClientSession, url: str, key: str) -> tuple[int, Any]:
    async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as response:
        body = await response.json(content_type=None) if response.status == 200 else await response.text()
        return response.status, body


async def probe(options: RunOptions) -> dict[str, Any]:
    """The endpoint's models (and workers and prices with the admin key); fails fast when it cannot be used."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        try:
            status, models = await _get(http, options.url + "/v1/models", options.api_key)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EndpointError(f"cannot reach {options.url}: {exc or type(exc).__name__}") from exc
        if status == 401:
            raise EndpointError(f"{options.url} refused the API key: pass its key with --api-key or KVMESH_API_KEY")
        if status != 200:
            raise EndpointError(f"{options.url}/v1/models answered HTTP {status}: {str(models)[:200]}")
        mesh: dict[str, Any] = {
            "url": options.url,
            "models": sorted(
                ({"id": m.get("id"), "max_model_len": m.get("max_model_len")} for m in models.get("data", [])),
                key=lambda m: str(m["id"]),
            ),
            "workers": None,
            "prices": None,
            "labels": dict(options.labels),
            "client_version": importlib.metadata.version("kvmesh"),
        }
        if options.admin_key:
            status, workers = await _get(http, options.url + "/v1/mesh/workers", options.admin_key)
            mesh["workers"] = _workers_summary(workers) if status == 200 else None
            status, prices = await _get(http, options.url + "/admin/v1/prices", options.admin_key)
            mesh["prices"] = prices.get("prices") if status == 200 else None
        return mesh


def _workers_summary(listing: dict[str, Any]) -> dict[str, Any]:
    """Per pool: how many workers, serving what at which versions, with what KV blocks (the shape of the
    deployment: a comparison of unlike shapes warns)."""
    summary = {}
    for pool, listed in sorted(listing.get("pools", {}).items()):
        workers = listed.get("workers", [])
        summary[pool] = {
            "num_workers": len(workers),
            "models": sorted({m for w in workers for m in w.get("models", [])}),
            "versions": sorted({w.get("version") for w in workers} - {None, ""}),  # KVMESH_VERSION each announces
            "block_sizes": sorted({w.get("kv", {}).get("block_size") for w in workers} - {None}),
            "num_kv_blocks": sum(w.get("kv", {}).get("num_blocks", 0) for w in workers),
        }
    return summary


def prices_from(listing: list[dict[str, Any]] | dict[str, Any], plan: str = "default") -> dict[str, ModelPrice]:
    """A price table: the admin API's `{"prices": [{plan, model, ...}]}` (rows of `plan`), or `{model: {...}}`."""
    rows = listing.get("prices", listing) if isinstance(listing, dict) else listing
    if isinstance(rows, dict):
        rows = [{"model": model, **row} for model, row in rows.items()]
    prices = {}
    for row in rows:
        if row.get("plan", plan) != plan:
            continue
        try:
            prices[row["model"]] = ModelPrice(
                float(row["input_per_mtok"]),
                float(row.get("cached_input_per_mtok", row["input_per_mtok"])),
                float(row["output_per_mtok"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a price needs model, input_per_mtok and output_per_mtok as numbers: {row!r}") from exc
    return prices


async def _session(
    session: Session, http: aiohttp.ClientSession, options: RunOptions, salt: str, t0: float, slots: asyncio.Semaphore
) -> list[RequestOutcome]:
    await asyncio.sleep(max(0.0, session.arrival_s - (time.perf_counter() - t0)))
    history = list(session.history)
    records = []
    due = session.arrival_s
    for index, turn in enumerate(session.turns):
        body = dict(turn.body)
        if history:
            body["messages"] = [*history, *turn.body["messages"]]
        record = RequestOutcome(session.source, index, turn.api, str(body.get("model", "")), due)
        async with slots:
            await send(http, options.url, options.api_key, record, streamed_body(turn.api, body, salt), t0)
        judge(record, turn)
        records.append(record)
        if not record.is_ok:
            break  # the rest of the conversation would be built on an answer that never came
        recorded = session.replies[index] if session.replies else None
        history = [*body.get("messages", []), {"role": "assistant", "content": recorded or record.text}]
        due = time.perf_counter() - t0
    return records


async def run_repeat(workload: EvalWorkload, options: RunOptions, salt: str) -> tuple[list[RequestOutcome], float]:
    """Every session of the workload once: (records, seconds from the first arrival to the last answer)."""
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    slots = asyncio.Semaphore(options.concurrency)
    connector = aiohttp.TCPConnector(limit=options.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=2**20) as http:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_session(s, http, options, salt, t0, slots) for s in workload.sessions))
        return [r for records in done for r in records], time.perf_counter() - t0


def run(
    workload: EvalWorkload,
    workload_options: WorkloadOptions,
    options: RunOptions,
    mesh: dict[str, Any],
    prices: dict[str, ModelPrice] | None,
    say: Any = None,
) -> dict[str, Any]:
    """The result: the workload's identity, the mesh, each repeat's metrics and records, and the summary."""
    run_id = secrets.token_hex(4)
    repeats: list[dict[str, Any]] = []
    for repeat in range(options.repeats):
        salt = f"kvmesh-eval-{run_id}-{repeat}" if options.is_salted else ""
        load_before = os.getloadavg()[0]
        records, duration = asyncio.run(run_repeat(workload, options, salt))
        metrics = repeat_metrics(records, duration, options.slo, prices)
        repeats.append(
            {
                "duration_s": duration,
                "load_average": [load_before, os.getloadavg()[0]],
                "metrics": metrics,
                "requests": [asdict(r) for r in records],
            }
        )
        if say is not None:
            say(
                f"repeat {repeat + 1}/{options.repeats}: {len(records)} requests in {duration:.1f}s, "
                f"errors {metrics['errors'] or 'none'}, TTFT p50 {_ms(metrics['ttft_p50'])}"
            )
    return {
        "kvmesh_eval": RESULT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workload": {
            "identity": workload.identity,
            "sources": workload.sources,
            "options": asdict(workload_options),
            "num_sessions": len(workload.sessions),
            "num_requests": workload.num_requests,
            "skipped": workload.skipped,
        },
        "mesh": mesh,
        "run": {
            "repeats": options.repeats,
            "concurrency": options.concurrency,
            "slo_s": options.slo,
            "is_salted": options.is_salted,
            "prices": {model: asdict(p) for model, p in (prices or {}).items()},
        },
        "summary": summarize([r["metrics"] for r in repeats]),
        "repeats": repeats,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
