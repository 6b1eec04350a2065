"""BFCL simple and parallel questions through tools with tool_choice "required" (kvmesh.bench.structured).

    .venv/bin/python bench/tools_bfcl.py [--model smollm2-135m] [--limit N] [--category simple_python parallel]

Prints one JSON report: per category, questions, calls, calls that parse and validate, accepted-answer matches.
"""

from __future__ import annotations

import argparse
import json

from kvmesh.bench.structured import run_bfcl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    parser.add_argument("--category", nargs="+", default=["simple_python", "parallel"])
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    report = run_bfcl(args.model, args.category, args.limit, args.max_tokens, batch_size=args.batch_size)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
