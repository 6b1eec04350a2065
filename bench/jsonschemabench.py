"""jsonschemabench (Glaiveai2K): the share of schemas structured output supports, and whether every generated
output for a supported schema validates (kvmesh.bench.structured).

    .venv/bin/python bench/jsonschemabench.py --data FILE [--model smollm2-135m] [--generate N | --generate-all]

FILE is Glaiveai2K as JSON Lines, one schema with its tests a line: the files of maskbench/data/Glaiveai2K in the
guidance-ai/jsonschemabench repository on GitHub, one file per line (tests/data/jsonschemabench holds the first 60).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh.bench.structured import run_jsonschemabench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="Glaiveai2K as JSON Lines, one schema with its tests a line: the files of maskbench/data/Glaiveai2K "
        "in the guidance-ai/jsonschemabench repository on GitHub, one file per line",
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=None, help="schemas to check (default: all)")
    parser.add_argument("--generate", type=int, default=100, help="supported schemas to generate for")
    parser.add_argument("--generate-all", action="store_true", help="generate for every supported schema")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    report = run_jsonschemabench(
        args.data,
        args.model,
        args.limit,
        None if args.generate_all else args.generate,
        args.max_tokens,
        batch_size=args.batch_size,
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
