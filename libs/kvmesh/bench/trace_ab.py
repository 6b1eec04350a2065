"""`kvmesh bench serve --trace-rounds N`: what tracing costs a request, against a baseline measured in the same run.

Two meshes side by side (serve.start_mesh), alike but for tracing: one exports every process's spans over
OTLP/gRPC to a receiver in this process, the other has no endpoint (tracing off). Both are warmed up, then N rounds:
in each, for each concurrency, the round's own prompts (new ones each round: no cache hits) go to one mesh and then
to the other, the order alternating round by round (on-off, off-on, ...) so a drift in the machine's load falls on
both sides alike. A round gives each side's p50 of the mesh's overhead (TTFT - the prefill engine's time), of TTFT
and of the gaps between tokens; the figures are the medians over rounds of each side and of the paired differences
(on - off), with every round's difference beside them to show the spread on a shared machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvmesh.bench.otlp_sink import OTLPSink
from kvmesh.bench.serve import API_KEY, Sample, make_prompts, one_request, percentile, start_mesh

NUM_WARM_UP = 4  # requests per mesh before the first round: lazy paths loaded, connections open


def _p50s(samples: Sequence[Sample]) -> dict[str, float]:
    return {
        "mesh_overhead_p50_ms": percentile([s.ttft_s - s.prefill_s for s in samples], 50) * 1000,
        "ttft_p50_ms": percentile([s.ttft_s for s in samples], 50) * 1000,
        "itl_p50_ms": percentile([g for s in samples for g in s.gaps_s], 50) * 1000,
    }


async def _send(
    session: aiohttp.ClientSession, url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int
) -> list[Sample]:
    semaphore = asyncio.Semaphore(concurrency)

    async def bounded(prompt: str) -> Sample:
        async with semaphore:
            return await one_request(session, url, API_KEY, model, prompt, max_tokens)

    return list(await asyncio.gather(*(bounded(p) for p in prompts)))


async def _rounds(
    urls: dict[bool, str],
    model: str,
    concurrencies: Sequence[int],
    num_requests: int,
    prompt_words: int,
    max_tokens: int,
    num_rounds: int,
) -> dict[tuple[int, bool], list[dict[str, float]]]:
    """Each (concurrency, tracing on) side's p50s, one entry per round."""
    found: dict[tuple[int, bool], list[dict[str, float]]] = {(c, on): [] for c in concurrencies for on in (False, True)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for url in urls.values():
            await _send(session, url, model, make_prompts(NUM_WARM_UP, prompt_words, seed=-1), 1, max_tokens)
        for index in range(num_rounds):
            for concurrency in concurrencies:
                prompts = make_prompts(num_requests, prompt_words, seed=index * 1000 + concurrency)
                for is_on in (True, False) if index % 2 == 0 else (False, True):
                    samples = await _send(session, urls[is_on], model, prompts, concurrency, max_tokens)
                    found[(concurrency, is_on)].append(_p50s(samples))
    return found


def _compared(rounds_off: list[dict[str, float]], rounds_on: list[dict[str, float]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key in rounds_off[0]:
        differences = [on[key] - off[key] for off, on in zip(rounds_off, rounds_on, strict=True)]
        result[key] = {
            "off": round(statistics.median(r[key] for r in rounds_off), 2),
            "on": round(statistics.median(r[key] for r in rounds_on), 2),
            "difference": round(statistics.median(differences), 2),
            "differences": [round(d, 2) for d in differences],
        }
    return result


def run_trace_ab(
    concurrencies: Sequence[int],
    num_requests: int,
    model: str,
    prompt_words: int,
    max_tokens: int,
    num_rounds: int,
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(OTLPSink())
        max_num_seqs = max(concurrencies)
        urls = {
            False: start_mesh(stack, model, max_num_seqs, API_KEY, {}),
            True: start_mesh(stack, model, max_num_seqs, API_KEY, sink.exporter_env()),
        }
        found = asyncio.run(_rounds(urls, model, concurrencies, num_requests, prompt_words, max_tokens, num_rounds))
        time.sleep(1.0)  # the batch processors' last exports
        num_traced = NUM_WARM_UP + num_rounds * num_requests * len(concurrencies)
        spans_per_request = len(sink.spans()) / num_traced
    by_concurrency = []
    for concurrency in concurrencies:
        compared = _compared(found[(concurrency, False)], found[(concurrency, True)])
        by_concurrency.append(
            {
                "concurrency": concurrency,
                **compared,
                "goal_overhead_p50_under_1ms": compared["mesh_overhead_p50_ms"]["difference"] < 1.0,
            }
        )
    return {
        "model": model,
        "rounds": num_rounds,
        "requests_per_round": num_requests,
        "prompt_words": prompt_words,
        "max_tokens": max_tokens,
        "spans_per_request": round(spans_per_request, 1),
        "by_concurrency": by_concurrency,
    }
