"""The sizing model behind `kvmesh bench scale`: a deployment of N GPUs, in pure arithmetic on named inputs.

Every input is an `Input`: a value, its kind and where it comes from. Kinds:
  seed        a figure of issue 19's seed (DeepSeek's deployment as the issue states it)
  published   a figure DeepSeek or 3FS published that the seed does not state (the source says where)
  assumption  kvmesh's own planning choice, not measured here: pass a better figure by its flag
  measured    measured by this command in this process (`mesh` code, timed or weighed: scale_measure.py)
  given       passed on the command line (a measured figure from elsewhere, or a test's fixed value)

`size(gpus, values)` is pure: the same values give the same figures, which the test checks exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
SECONDS_PER_DAY = 86_400
DS_NODES = 226.75  # DeepSeek's average inference nodes over the day its day-6 figures cover (8 H800 each)


@dataclass(frozen=True)
class Input:
    value: float
    kind: str  # seed | published | assumption | measured | given
    source: str


DEFAULTS: dict[str, Input] = {
    "logical_kv_tb_per_gpu": Input(14.4, "seed", "issue 19: ~14.4 TB of logical KV per GPU"),
    "ec_data": Input(10, "seed", "issue 19: 10+2 erasure coding (k)"),
    "ec_parity": Input(2, "seed", "issue 19: 10+2 erasure coding (m)"),
    "node_gbps": Input(400, "seed", "issue 19: ~400 Gbps of interconnect per 8 GPUs (one node)"),
    "ttl_short_days": Input(3, "seed", "issue 19: 3-day TTL"),
    "ttl_long_days": Input(7, "seed", "issue 19: 7-day TTL"),
    "store_hit_fraction": Input(0.563, "seed", "ANCHORS.md: DeepSeek serves 56.3% of input tokens from its SSD cache"),
    "gpus_per_node": Input(8, "seed", "issue 19: figures per 8 GPUs"),
    "kv_bytes_per_token": Input(
        70_272, "published", "DeepSeek-V3 config.json: MLA latent 512 + rope 64 per layer, 61 layers, bf16"
    ),
    "input_tokens_per_s_per_gpu": Input(
        3_879,
        "published",
        "DeepSeek Open Infra day 6: 608B input tokens/day over 226.75 nodes of 8 GPUs, averaged over all GPUs",
    ),
    "output_tokens_per_s_per_gpu": Input(
        1_072, "published", "DeepSeek Open Infra day 6: 168B output tokens/day over 226.75 nodes, over all GPUs"
    ),
    "prefill_tokens_per_s_per_node": Input(
        73_700, "published", "DeepSeek Open Infra day 6: ~73.7k input tokens/s per H800 node while prefilling"
    ),
    "decode_tokens_per_s_per_node": Input(
        14_800, "published", "DeepSeek Open Infra day 6: ~14.8k output tokens/s per H800 node while decoding"
    ),
    "store_node_ssd_tb": Input(246.3, "published", "3FS README: a storage node holds 16 NVMe SSDs of 14 TiB"),
    "store_node_gbps": Input(400, "published", "3FS README: a storage node has 2 x 200 Gbps InfiniBand"),
    "block_tokens": Input(16, "assumption", "kvmesh's block size (vLLM's default; KVMESH block keys per 16 tokens)"),
    "prompt_tokens": Input(4_000, "assumption", "mean prompt per request: DeepSeek publishes none; --prompt-tokens"),
    "device_kv_gb_per_gpu": Input(40, "assumption", "device KV cache per GPU (half of an 80 GB H800); --device-kv-gb"),
    "store_host_gb": Input(512, "assumption", "a store node's host-memory tier; --store-host-gb"),
    "ssd_fill": Input(0.9, "assumption", "SSD filled to 90%: room to rebuild a lost node's fragments"),
    "store_events_per_fragment": Input(
        4, "assumption", "a fragment is stored in host, then SSD, and removed from each: 4 keys in KV events"
    ),
    "keys_per_batch": Input(16, "assumption", "block keys per KVEventBatch (one put's run of one tier)"),
    "stream_msgs_per_s": Input(
        50_000, "assumption", "what one JetStream stream (R=3, file storage) takes, as planning headroom; not measured"
    ),
    "stream_mb_per_s": Input(100, "assumption", "bytes one JetStream stream (R=3) takes, planning headroom"),
    "nats_overhead_bytes": Input(80, "assumption", "a NATS message's framing beside its payload (subject, headers)"),
    "balancer_memory_gib": Input(64, "assumption", "memory one balancer replica may use"),
    "core_target": Input(0.7, "assumption", "the busiest a core is planned to be (queueing past that)"),
    "link_target": Input(0.7, "assumption", "the busiest a store node's NIC is planned to be"),
    "lane_gbytes_per_s": Input(
        2.0,
        "given",
        "docs/benchmarks.md: one protected lane (TLS), kv-transfer on a quiet machine, 1.59-2.01 GB/s; "
        "--lane-gbytes-per-s or --measure-lane",
    ),
    "gateway_tokens_per_s_per_core": Input(
        20_000, "assumption", "streamed output tokens one gateway core detokenizes and sends; not measured here"
    ),
    "gateway_requests_per_s_per_core": Input(
        500, "assumption", "requests one gateway core admits, templates and tokenizes; not measured here"
    ),
    "admission_decisions_per_s": Input(
        2_000,
        "given",
        "docs/benchmarks.md: `kvmesh bench admission`, 3 limiters sharing one key's counters, 1,535-3,494/s",
    ),
    # measured by scale_measure.py unless given: these defaults are only placeholders for the keys' documentation
    "index_bytes_per_key": Input(0, "measured", "GlobalKVIndex, tracemalloc over 1-holder keys"),
    "index_bytes_per_holding": Input(0, "measured", "GlobalKVIndex, tracemalloc: 12 holders a key less 1"),
    "index_apply_us_per_key": Input(0, "measured", "GlobalKVIndex.apply of stored + removed batches, per key"),
    "event_batch_bytes": Input(0, "measured", "KVEventBatch of keys_per_batch stored fragments, serialized"),
    "snapshot_bytes_per_holding": Input(0, "measured", "KVIndexSnapshot of the 12-holder index, serialized"),
    "restore_holdings_per_s": Input(0, "measured", "KVIndexSnapshot.FromString + GlobalKVIndex.restore"),
    "route_us": Input(0, "measured", "Router('kvmesh').route over 16+16 workers, prompt_tokens of blocks"),
    "apply_assignment_us": Input(0, "measured", "Router.apply of a peer replica's Assignment"),
}
MEASURED = tuple(name for name, spec in DEFAULTS.items() if spec.kind == "measured")


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))  # 3.0000000001 from float noise is 3


def _r(x: float, digits: int = 3) -> float:
    return round(x, digits)


def size(gpus: int, v: Mapping[str, float]) -> dict[str, Any]:
    """The deployment of `gpus` GPUs from the input values `v` (every key of DEFAULTS)."""
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus}")
    traffic = _traffic(gpus, v)
    store = _store(gpus, v, traffic)
    index = _index(gpus, v, store)
    events = _events(v, traffic, index)
    lanes = _lanes(v, traffic, store)
    balancer = _balancer(gpus, v, traffic, events, index)
    gateway = _gateway(v, traffic)
    events["cell_streams"] = balancer["cells"]  # device events: one stream per cell, followed by its balancers
    limits = _limits(v, index, events, lanes, balancer, gateway)
    return {
        "gpus": gpus,
        "nodes": _ceil(gpus / v["gpus_per_node"]),
        "traffic": traffic,
        "store": store,
        "index": index,
        "kv_events": events,
        "snapshot": _snapshot(v, index),
        "lanes": lanes,
        "balancer": balancer,
        "gateway": gateway,
        "limits": limits,
        "breaks_first": max(limits, key=lambda name: limits[name]["ratio"]),
    }


def _traffic(gpus: int, v: Mapping[str, float]) -> dict[str, Any]:
    input_tps = gpus * v["input_tokens_per_s_per_gpu"]
    output_tps = gpus * v["output_tokens_per_s_per_gpu"]
    cached_tps = input_tps * v["store_hit_fraction"]
    prefill_nodes = input_tps / v["prefill_tokens_per_s_per_node"]
    decode_nodes = output_tps / v["decode_tokens_per_s_per_node"]
    return {
        "input_tokens_per_s": _r(input_tps, 1),
        "output_tokens_per_s": _r(output_tps, 1),
        "store_hit_tokens_per_s": _r(cached_tps, 1),
        "computed_tokens_per_s": _r(input_tps - cached_tps, 1),
        "requests_per_s": _r(input_tps / v["prompt_tokens"], 1),
        "prefill_nodes": _ceil(prefill_nodes),
        "decode_nodes": _ceil(decode_nodes),
        "pool_nodes_vs_gpus": _r((prefill_nodes + decode_nodes) * v["gpus_per_node"] / gpus),
    }


def _store(gpus: int, v: Mapping[str, float], traffic: Mapping[str, float]) -> dict[str, Any]:
    k, n = v["ec_data"], v["ec_data"] + v["ec_parity"]
    block_bytes = v["kv_bytes_per_token"] * v["block_tokens"]
    logical = gpus * v["logical_kv_tb_per_gpu"] * 1e12
    physical = logical * n / k
    write_logical = traffic["computed_tokens_per_s"] * v["kv_bytes_per_token"]  # prefill writes what it computed
    write_physical = write_logical * n / k
    read = traffic["store_hit_tokens_per_s"] * v["kv_bytes_per_token"]  # k fragments of 1/k each: the block's size
    by_capacity = _ceil(physical / (v["store_node_ssd_tb"] * 1e12 * v["ssd_fill"]))
    by_network = _ceil((write_physical + read) * 8 / (v["store_node_gbps"] * 1e9 * v["link_target"]))
    num_nodes = max(by_capacity, by_network, int(n))
    retention_days = logical / write_logical / SECONDS_PER_DAY
    return {
        "block_bytes": int(block_bytes),
        "fragment_bytes": _r(block_bytes / k, 1),
        "logical_pb": _r(logical / 1e15),
        "physical_pb": _r(physical / 1e15),
        "blocks": int(logical / block_bytes),
        "fragments": int(logical / block_bytes * n),
        "write_gbytes_per_s": _r(write_physical / 1e9),
        "read_gbytes_per_s": _r(read / 1e9),
        "nodes_by_capacity": by_capacity,
        "nodes_by_network": by_network,
        "nodes": num_nodes,
        "ssd_tb_per_node": _r(physical / num_nodes / 1e12, 1),
        "retention_days_at_write_rate": _r(retention_days, 2),
        "capacity_evicts_before_ttl": retention_days < v["ttl_short_days"],
    }


def _index(gpus: int, v: Mapping[str, float], store: Mapping[str, Any]) -> dict[str, Any]:
    """Today every balancer follows every tier: each SSD fragment is a holding. Proposed: balancers follow the
    device and host tiers only; the SSD tier is asked of a block's rendezvous nodes (mesh.placement, the store
    client's Lookup), which already answer for what they hold."""
    n = v["ec_data"] + v["ec_parity"]
    device_blocks = gpus * v["device_kv_gb_per_gpu"] * 1e9 / store["block_bytes"]
    host_fragments = store["nodes"] * v["store_host_gb"] * 1e9 / store["fragment_bytes"]
    full_keys, full_holdings = store["blocks"] + device_blocks, store["fragments"] + device_blocks
    hot_keys, hot_holdings = device_blocks + host_fragments / n, device_blocks + host_fragments

    def gib(keys: float, holdings: float) -> float:
        return _r((keys * v["index_bytes_per_key"] + holdings * v["index_bytes_per_holding"]) / GIB, 2)

    return {
        "device_blocks": int(device_blocks),
        "host_fragments": int(host_fragments),
        "every_tier": {"keys": int(full_keys), "holdings": int(full_holdings), "gib": gib(full_keys, full_holdings)},
        "device_and_host": {"keys": int(hot_keys), "holdings": int(hot_holdings), "gib": gib(hot_keys, hot_holdings)},
    }


def _events(v: Mapping[str, float], traffic: Mapping[str, float], index: Mapping[str, Any]) -> dict[str, Any]:
    bt, n = v["block_tokens"], v["ec_data"] + v["ec_parity"]
    # a block enters and leaves a device cache: prefill holds every prompt block, decode every prompt and output one
    device = 2 * (2 * traffic["input_tokens_per_s"] + traffic["output_tokens_per_s"]) / bt
    store = traffic["computed_tokens_per_s"] / bt * n * v["store_events_per_fragment"]
    host = store / 2  # host stored + host removed of the four
    keys = device + store
    batches = keys / v["keys_per_batch"]
    wire = batches * (v["event_batch_bytes"] + v["nats_overhead_bytes"])
    shards = max(_ceil(batches / v["stream_msgs_per_s"]), _ceil(wire / (v["stream_mb_per_s"] * 1e6)))
    return {
        "device_keys_per_s": _r(device, 1),
        "store_keys_per_s": _r(store, 1),
        "keys_per_s": _r(keys, 1),
        "batches_per_s": _r(batches, 1),
        "mbytes_per_s": _r(wire / 1e6, 2),
        "device_and_host_keys_per_s": _r(device + host, 1),
        "shards": shards,
        "subjects": "kvmesh.kv.<shard>.<worker_id>: a device worker's shard is its balancer cell, a store node's "
        "crc32(worker_id) % shards",
        "streams": f"KVMESH_KV_<shard> (subjects kvmesh.kv.<shard>.>), R=3, leaders spread; {shards} by rate",
        "batches_per_s_per_shard": _r(batches / shards, 1),
    }


def _snapshot(v: Mapping[str, float], index: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name in ("every_tier", "device_and_host"):
        holdings = index[name]["holdings"]
        out[name] = {
            "gbytes": _r(holdings * v["snapshot_bytes_per_holding"] / 1e9, 2),
            "restore_s": _r(holdings / v["restore_holdings_per_s"], 1),
        }
    return out


def _lanes(v: Mapping[str, float], traffic: Mapping[str, Any], store: Mapping[str, Any]) -> dict[str, Any]:
    """Bytes each node moves a second against its NIC and against one lane process (`lane_gbytes_per_s`)."""
    kv, n, k = v["kv_bytes_per_token"], v["ec_data"] + v["ec_parity"], v["ec_data"]
    node_gbytes = v["node_gbps"] / 8
    prefill_tps = v["prefill_tokens_per_s_per_node"]
    push = prefill_tps * kv  # every prompt's KV goes to decode
    fetch = prefill_tps * v["store_hit_fraction"] * kv
    write = prefill_tps * (1 - v["store_hit_fraction"]) * kv * n / k
    prefill_out, prefill_in = (push + write) / 1e9, fetch / 1e9
    decode_in = traffic["input_tokens_per_s"] * kv / max(traffic["decode_nodes"], 1) / 1e9
    store_node = (store["write_gbytes_per_s"] + store["read_gbytes_per_s"]) / store["nodes"]
    lane = v["lane_gbytes_per_s"]
    return {
        "available_gbytes_per_s_per_node": _r(node_gbytes),
        "prefill_node_out_gbytes_per_s": _r(prefill_out),
        "prefill_node_in_gbytes_per_s": _r(prefill_in),
        "decode_node_in_gbytes_per_s": _r(decode_in),
        "store_node_gbytes_per_s": _r(store_node),
        "lane_processes_per_prefill_node": _ceil(max(prefill_out, prefill_in) / lane),
        "lane_processes_per_decode_node": _ceil(decode_in / lane),
        "lane_processes_per_store_node": _ceil(store_node / lane),
    }


def _balancer(
    gpus: int, v: Mapping[str, float], traffic: Mapping[str, Any], events: Mapping[str, Any], index: Mapping[str, Any]
) -> dict[str, Any]:
    """Every replica routes rate/R and applies the other replicas' assignments and every KV event it follows, on
    one core (a Python process). One balancer set for the whole deployment cannot keep up past a size, so the
    proposal is cells: a cell is a prefill + decode pool with its own balancer replicas, following only its own
    workers' device-tier events (the store's tiers are asked of their rendezvous nodes). A cell holds as many
    GPUs as one replica's core (`core_target`) and memory allow; per cell, the smallest R >= 2 under the target."""
    rate_per_gpu = traffic["requests_per_s"] / gpus
    route_s, apply_s, event_s = v["route_us"] / 1e6, v["apply_assignment_us"] / 1e6, v["index_apply_us_per_key"] / 1e6
    shared_per_gpu = events["device_keys_per_s"] / gpus * event_s + rate_per_gpu * apply_s  # every replica's part
    bytes_per_gpu = (index["device_blocks"] / gpus) * (v["index_bytes_per_key"] + v["index_bytes_per_holding"])
    by_core = v["core_target"] / (shared_per_gpu + rate_per_gpu * route_s / 2)
    cell_gpus = max(1, min(int(by_core), int(v["balancer_memory_gib"] * GIB / bytes_per_gpu), gpus))
    num_cells = _ceil(gpus / cell_gpus)
    cell_rate = rate_per_gpu * gpus / num_cells

    def load(replicas: int) -> float:
        shared = events["device_keys_per_s"] / num_cells * event_s + cell_rate * (replicas - 1) / replicas * apply_s
        return cell_rate / replicas * route_s + shared

    replicas = next((r for r in range(2, 257) if load(r) <= v["core_target"]), 256)
    return {
        "decisions_per_s": traffic["requests_per_s"],
        "decisions_per_s_per_core": _r(1 / route_s, 1),
        "event_apply_cores_every_tier": _r(events["keys_per_s"] * event_s, 3),
        "event_apply_cores_device_and_host": _r(events["device_and_host_keys_per_s"] * event_s, 3),
        "event_apply_cores_device": _r(events["device_keys_per_s"] * event_s, 3),
        "cell_gpus": cell_gpus,
        "cells": num_cells,
        "replicas_per_cell": replicas,
        "replicas": replicas * num_cells,
        "core_load_per_replica": _r(load(replicas), 3),
        "index_gib_per_replica": _r(bytes_per_gpu * gpus / num_cells / GIB, 2),
    }


def _gateway(v: Mapping[str, float], traffic: Mapping[str, Any]) -> dict[str, Any]:
    cores = max(
        traffic["requests_per_s"] / v["gateway_requests_per_s_per_core"],
        traffic["output_tokens_per_s"] / v["gateway_tokens_per_s_per_core"],
    )
    return {
        "cores": _r(cores, 2),
        "replicas": max(2, _ceil(cores / v["core_target"])),
        "admission_load": _r(traffic["requests_per_s"] / v["admission_decisions_per_s"]),
    }


def _limits(
    v: Mapping[str, float],
    index: Mapping[str, Any],
    events: Mapping[str, Any],
    lanes: Mapping[str, Any],
    balancer: Mapping[str, Any],
    gateway: Mapping[str, Any],
) -> dict[str, dict[str, float]]:
    """Need over what one unit has, for the design as it is today (one stream, every tier indexed): > 1 breaks."""
    node = lanes["available_gbytes_per_s_per_node"]

    def limit(need: float, available: float) -> dict[str, float]:
        return {"need": _r(need, 3), "available": _r(available, 3), "ratio": _r(need / available, 3)}

    return {
        "balancer_index_memory_gib": limit(index["every_tier"]["gib"], v["balancer_memory_gib"]),
        "balancer_event_apply_cores": limit(balancer["event_apply_cores_every_tier"], v["core_target"]),
        "kv_stream_batches_per_s": limit(events["batches_per_s"], v["stream_msgs_per_s"]),
        "prefill_node_nic_gbytes_per_s": limit(lanes["prefill_node_out_gbytes_per_s"], node),
        "prefill_node_one_lane_gbytes_per_s": limit(lanes["prefill_node_out_gbytes_per_s"], v["lane_gbytes_per_s"]),
        "store_node_nic_gbytes_per_s": limit(lanes["store_node_gbytes_per_s"], v["store_node_gbps"] / 8),
        "admission_decisions_per_s": limit(balancer["decisions_per_s"], v["admission_decisions_per_s"]),
    }
