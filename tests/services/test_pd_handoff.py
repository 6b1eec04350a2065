"""A prefill worker hands a request's KV to a decode worker over real gRPC on loopback (and a real NATS): the
decode stream gives exactly the tokens and logprobs of one engine, and a request that ends at its first token
pushes nothing.

Harness: the `mesh` fixture of tests/services/pd_harness.py (in-process workers).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine_core.kv_cache.manager import cdiv
from kvmesh.nats_server import free_port
from mesh.pb import common_pb2, decode_pb2

from . import pd_harness
from .pd_harness import (
    GREEDY,
    HEARTBEAT_S,
    Mesh,
    engine_stats,
    metric,
    prompt_of,
    reference_outputs,
    scrape,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, nats_url = pd_harness.mesh, pd_harness.nats_url  # fixtures: each test file starts its own mesh


@pytest.mark.parametrize("which", ["llama", "deepseek"])
async def test_a_handoff_streams_exactly_the_tokens_of_one_engine(mesh: Mesh, which: str):
    model = getattr(mesh, which)
    prompt = prompt_of(37, seed=1)
    params = dataclasses.replace(GREEDY, logprobs=2)
    expected, expected_logprobs = reference_outputs(model, prompt, params)

    def moved() -> float:
        return metric("kvmesh_kv_transfer_bytes_total", direction="prefill_to_decode")

    def queued() -> tuple[float, float]:  # the prefill engine's queue time (vLLM's request_queue_time_seconds)
        name = "kvmesh:request_queue_time_seconds"
        return metric(f"{name}_count", model_name=model), metric(f"{name}_sum", model_name=model)

    moved_before, queued_before = moved(), queued()
    response = await mesh.prefill_stub.Prefill(mesh.request(f"handoff-{which}", model, prompt, params))
    assert response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    num_queued, queue_s = (after - before for after, before in zip(queued(), queued_before, strict=True))
    assert num_queued == 1 and 0 <= queue_s <= response.prefill_seconds  # the wait is part of prefill's time
    assert moved() == moved_before + 2 * response.kv_bytes_sent  # both ends count, into this process's registry
    assert (response.worker_id, response.num_prompt_tokens, response.num_cached_tokens) == ("prefill-t", 37, 0)
    layout = mesh.decode.engines.layout(model)
    assert response.kv_bytes_sent == layout.num_layers * layout.chunk_bytes(cdiv(37, 16))  # the exported size
    batches = [b async for b in mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id=f"handoff-{which}"))]
    tokens = [response.first_token_id] + [t for b in batches for t in b.token_ids]
    assert tokens == expected
    assert [b.num_output_tokens for b in batches] == list(range(2, 11))
    assert [b.finish_reason for b in batches] == [0] * 8 + [common_pb2.FINISH_REASON_LENGTH]
    logprobs = [response.first_logprob] + [lp for b in batches for lp in b.logprobs]
    assert [(lp.token_id, lp.rank, len(lp.top_token_ids)) for lp in logprobs] == [
        (lp.token_id, lp.rank, 2) for lp in expected_logprobs
    ]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in expected_logprobs], abs=1e-4)

    stats = await engine_stats(mesh.decode, model)
    assert stats.num_prompt_tokens_computed == 0 and stats.num_generated_tokens >= 9  # decode never recomputed
    await wait_for_free_blocks(mesh.decode, model)
    await wait_for_free_blocks(mesh.prefill, model)  # the kept request was released
    await asyncio.sleep(2 * HEARTBEAT_S)  # decode exports its gauges every heartbeat interval
    # the endpoint is served by this very loop: scrape from a thread
    samples = await asyncio.to_thread(scrape, mesh.decode.runtime.http_port, "kvmesh_decode_prompt_tokens_computed")
    assert samples[f'{{model="{model}"}}'] == 0


async def test_a_first_token_that_ends_the_request_pushes_nothing(mesh: Mesh):
    prompt = prompt_of(30, seed=2)
    expected, _ = reference_outputs(mesh.llama, prompt, GREEDY)
    nowhere = dict(
        decode_address=f"127.0.0.1:{free_port()}",
        decode_worker_id="decode-nowhere",
        decode_data_address=f"127.0.0.1:{free_port()}",
    )
    one = await mesh.prefill_stub.Prefill(
        mesh.request("one-token", mesh.llama, prompt, dataclasses.replace(GREEDY, max_tokens=1), **nowhere)
    )
    assert (one.first_token_id, one.finish_reason, one.kv_bytes_sent) == (
        expected[0],
        common_pb2.FINISH_REASON_LENGTH,
        0,
    )
    stop = await mesh.prefill_stub.Prefill(
        mesh.request(
            "stop-token",
            mesh.llama,
            prompt,
            dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=[expected[0]]),
            **nowhere,
        )
    )
    assert (stop.first_token_id, stop.finish_reason, stop.kv_bytes_sent) == (
        expected[0],
        common_pb2.FINISH_REASON_STOP,
        0,
    )
    assert stop.num_cached_tokens == 16  # the first request left its full block in the device cache
    await wait_for_free_blocks(mesh.prefill, mesh.llama)
