"""The KV cache system in a real mesh: three KV store nodes (2+1 erasure coding, SSD tier), two prefill workers.
A KV store node killed with SIGKILL loses no block and fails no request; when it comes back it announces its SSD
again."""

from __future__ import annotations

import concurrent.futures
import signal

import openai
import pytest

from .conftest import API_KEY, scrape, start_mesh, wait_until

MODEL = "smollm2-135m"
DOCUMENT = " ".join(
    f"Note {i}: the lighthouse on island {i} is painted {('red', 'blue', 'green')[i % 3]}." for i in range(16)
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("kvmesh")
    mesh = start_mesh(
        base / "mesh.log",
        prefill=2,
        decode=1,
        kvcache=3,
        models=(MODEL,),
        env_extra={
            "KVMESH_KV_PROTECTION": "2+1",
            "KVMESH_DATA_DIR": str(base / "ssd"),
            "KVMESH_REPAIR_DELAY_S": "1",
            "KVMESH_KV_FETCH": "always",  # every stored block read, whatever the rates: the reads are the subject
        },
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, content: str, max_tokens: int = 2):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
    )
    return raw.parse(), raw.headers


def fragments_held(mesh) -> float:
    return sum(
        scrape(mesh.child(f"kvcache-{i}").http_port, "kvmesh_kvcache_blocks").get('{tier="host"}', 0)
        for i in range(3)
        if mesh.child(f"kvcache-{i}").process.poll() is None
    )


def ssd_blocks(mesh, name: str) -> float:
    try:
        return scrape(mesh.child(name).http_port, "kvmesh_kvcache_blocks").get('{tier="ssd"}', 0)
    except OSError:  # not serving yet
        return 0


def test_a_killed_store_node_loses_no_block_and_fails_no_request(mesh, client):
    first, headers = chat(client, DOCUMENT + " Which lighthouse is blue?")
    num_blocks = (first.usage.prompt_tokens - 1) // 16  # the last prompt token is always computed
    wait_until(lambda: fragments_held(mesh) >= 3 * num_blocks, 30, "every block as 3 fragments on 3 nodes")

    mesh.kill("kvcache-1", signal.SIGKILL)  # no goodbye: it stays in the pools until its heartbeats are missed
    mesh.kill(headers["x-kvmesh-prefill-worker"], signal.SIGTERM)  # its device cache goes with it
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = list(pool.map(lambda n: chat(client, f"Count to {n}."), range(6)))
        second, second_headers = chat(client, DOCUMENT + " Which lighthouse is blue?")
    assert all(r.choices[0].message.content for r, _ in others)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens == 16 * num_blocks  # all of it, from the store
    store_tokens = scrape(
        mesh.child(second_headers["x-kvmesh-prefill-worker"]).http_port, "kvmesh_prefill_cached_tokens_total"
    )
    assert store_tokens.get(f'{{model="{MODEL}",tier="store"}}', 0) >= 16 * num_blocks
    # read layer-major while computing (the dead node's blocks detour through parity), or, once the dead node
    # has left the pools, fetched whole with parity decoded
    reads = scrape(mesh.child(second_headers["x-kvmesh-prefill-worker"]).http_port, "kvmesh_prefill_store_reads_total")
    assert reads.get('{mode="stream"}', 0) + reads.get('{mode="fetch"}', 0) >= 1

    mesh.spawn("kvcache", 1)  # back with its SSD directory: it announces its fragments again
    wait_until(lambda: ssd_blocks(mesh, "kvcache-1") >= num_blocks, 60, "the returned node to take back its files")
