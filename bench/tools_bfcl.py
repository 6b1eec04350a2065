"""BFCL simple and parallel questions through tools with tool_choice "required" (kvmesh.bench.structured).

    .venv/bin/python bench/tools_bfcl.py --data DIR [--model smollm2-135m] [--limit N] [--category C ...]

Prints one JSON report: per category, questions, calls, calls that parse and validate, accepted-answer matches.
DIR is BFCL v4's data folder: berkeley-function-call-leaderboard/bfcl_eval/data in the ShishirPatil/gorilla
repository on GitHub (tests/data/bfcl holds the first 3 questions of each category, for the tests).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh.bench.structured import run_bfcl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="BFCL v4's data folder (BFCL_v4_<category>.json, possible_answer_BFCL_v4_<category>.json): "
        "berkeley-function-call-leaderboard/bfcl_eval/data in the ShishirPatil/gorilla repository on GitHub",
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    parser.add_argument("--category", nargs="+", default=["simple_python", "parallel"])
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    report = run_bfcl(args.data, args.model, args.category, args.limit, args.max_tokens, batch_size=args.batch_size)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
