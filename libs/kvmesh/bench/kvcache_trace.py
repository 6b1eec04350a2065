"""A generated trace for `kvmesh bench kvcache --trace generated`: a reuse pattern neither Mooncake trace has.

Tool and agent prompts: `num_templates` shared prefixes (system prompt and tool schemas, 4-40 blocks each) whose
popularity follows a Zipf law (s=1.1), each request one template plus 1-6 blocks of its own; and among them
one request in five is a one-off scan (a long pasted document, 20-60 blocks never seen again). Reuse is skewed by
frequency, not by recency (the conversation trace) or by documents coming back (the synthetic one). Seeded, so
the same every run; the same shape as `load_trace`'s answer.
"""

from __future__ import annotations

import bisect
import itertools
import random

NAME = "generated"


def generate_trace(num_requests: int = 6000, num_templates: int = 400, seed: int = 22) -> list[tuple[float, list[int]]]:
    rng = random.Random(seed)
    next_id = itertools.count()
    templates = [[next(next_id) for _ in range(rng.randint(4, 40))] for _ in range(num_templates)]
    weights = list(itertools.accumulate(1.0 / (rank + 1) ** 1.1 for rank in range(num_templates)))
    requests = []
    for number in range(num_requests):
        timestamp = number * 0.1
        if rng.random() < 0.2:
            requests.append((timestamp, [next(next_id) for _ in range(rng.randint(20, 60))]))
            continue
        template = templates[bisect.bisect(weights, rng.random() * weights[-1])]
        requests.append((timestamp, [*template, *(next(next_id) for _ in range(rng.randint(1, 6)))]))
    return requests
