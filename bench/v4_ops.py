"""deepseek-v4-tiny: torch operators the engine dispatches per step (deterministic counts, no timing).

On a shared CPU a step's time follows its operator count more than its FLOPs: each parallel operator waits for
every torch thread to be scheduled. Serves C requests (prompts of 16-64 random token ids, seed 0, 16 greedy output
tokens each) after one warm-up, under torch.profiler, and prints one JSON object per concurrency: aten operators per
step (all, and without views and allocations), GEMMs (mm/addmm/bmm) and softmaxes per step, and the last 4 tokens
of each request (so two trees can be compared token for token).

    PYTHONPATH=libs:. python bench/v4_ops.py [--concurrency 1 8]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams

VIEWS = {
    *("as_strided", "slice", "select", "view", "unsqueeze", "reshape", "transpose", "narrow", "expand", "t"),
    *("permute", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "resolve_conj", "resolve_neg"),
    *("detach", "alias", "empty", "empty_strided", "empty_like", "item", "_local_scalar_dense", "_unsafe_view"),
    *("flatten", "lift_fresh", "view_as", "contiguous", "_reshape_alias", "unflatten"),
}
GEMMS = {"mm", "addmm", "bmm"}
OUTPUT_TOKENS = 16


def count(llm: LLM, concurrency: int) -> dict[str, object]:
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 120000) for _ in range(rng.randint(16, 64))] for _ in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(prompts, params)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = llm.generate(prompts, params)
    ops = {e.key.removeprefix("aten::"): e.count for e in prof.key_averages() if e.key.startswith("aten::")}

    def per_step(keep: Callable[[str], bool]) -> float:
        return round(sum(n for name, n in ops.items() if keep(name)) / OUTPUT_TOKENS, 1)

    return {
        "concurrency": concurrency,
        "aten_ops_per_step": per_step(lambda name: True),
        "non_view_ops_per_step": per_step(lambda name: name not in VIEWS),
        "gemms_per_step": per_step(lambda name: name in GEMMS),
        "softmaxes_per_step": per_step(lambda name: name == "_softmax"),
        "last_tokens": [out.token_ids[-4:] for out in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = LLM("deepseek-v4-tiny", enable_prefix_caching=False, block_size=16, num_kv_blocks=64, max_num_seqs=64)
    for concurrency in args.concurrency:
        print(json.dumps(count(llm, concurrency)))


if __name__ == "__main__":
    main()
