"""Time and profile one decode step of the engine at a given batch size (the figures in docs/engine.md).

    PYTHONPATH=libs:. python bench/decode_step.py --batch 32 --steps 20 [--profile] [--model smollm2-135m]
        [--quantization int8] [--cpu-decode-kernel]

Builds an `LLM`, admits `batch` greedy requests whose prompts are slices of the engine bench's paragraph with
lengths drawn from 32..256 (seeded: the same contexts every run), runs until every request decodes, then times
`steps` decode steps: the whole `engine.step()` (wall and process CPU time: on a machine others share, CPU time at
--threads 1 is the steadier figure) and the model's forward pass alone (`runner.execute`). Prints one line of JSON;
with --profile, first a torch.profiler table of one more step (ops by self CPU time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine_core import LLM, SamplingParams
from kvmesh.bench.engine import PROMPT_TEXT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quantization", default="none", help="none or int8 (the engine's KVMESH_QUANTIZATION)")
    parser.add_argument(
        "--cpu-decode-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode attention by the C++ kernel (KVMESH_CPU_DECODE_KERNEL; --no-cpu-decode-kernel: gather + SDPA)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        enable_prefix_caching=False,
        block_size=16,
        max_num_seqs=max(64, args.batch),
        quantization=args.quantization,
        cpu_decode_kernel=args.cpu_decode_kernel,
    )
    engine = llm.engine
    source = engine.tokenizer.encode(PROMPT_TEXT, add_special_tokens=False) if engine.tokenizer else list(range(500))
    rng = random.Random(args.seed)
    for i in range(args.batch):
        start, length = rng.randrange(len(source)), rng.randint(*args.prompt_lens)
        prompt = [source[(start + j) % len(source)] for j in range(length)]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in running):
        engine.step()
    for _ in range(3):  # warm-up
        engine.step()
    step_s, step_cpu_s, forward_s = [], [], []
    runner, execute = engine.runner, engine.runner.execute

    def timed_execute(output, *rest):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        logits = execute(output, *rest)
        forward_s.append(time.perf_counter() - began)
        return logits

    runner.execute = timed_execute  # type: ignore[method-assign]
    for _ in range(args.steps):
        began, began_cpu = time.perf_counter(), time.process_time()
        engine.step()
        step_s.append(time.perf_counter() - began)
        step_cpu_s.append(time.process_time() - began_cpu)
    runner.execute = execute  # type: ignore[method-assign]
    lens = [r.num_computed_tokens + 1 for r in engine.scheduler.running]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    step_ms = statistics.median(step_s) * 1e3
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "context_mean": round(statistics.mean(lens), 1),
                "context_max": max(lens),
                "step_ms_median": round(step_ms, 2),
                "step_cpu_ms_median": round(statistics.median(step_cpu_s) * 1e3, 2),
                "forward_ms_median": round(statistics.median(forward_s) * 1e3, 2),
                "tok_s": round(args.batch / step_ms * 1e3, 1),
                "step_ms": [round(s * 1e3, 1) for s in step_s],
            }
        )
    )


if __name__ == "__main__":
    main()
