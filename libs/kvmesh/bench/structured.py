"""Evaluations of tool calls and structured output (figures to report, never to tune to).

    BFCL (Berkeley Function Calling Leaderboard v4, simple and parallel questions): each question's functions
    become tools (BFCL's types dict/float/tuple/any mapped to object/number/array/{}), generated with
    tool_choice "required" under the gateway's grammar. Every call must parse and validate against its
    tool's schema; how many questions match an accepted answer (BFCL's AST check, simplified) is reported.
    jsonschemabench (Glaiveai2K): the share of schemas the grammar supports (gateway's schema_support), and
    for supported ones, whether every generated output validates (jsonschema, with format checks).

The gateway's own pieces do the work (tool formats, prompt rendering, grammars, the parser, the schema
checks) over an in-process engine, so a run needs no mesh. `bench/tools_bfcl.py` and
`bench/jsonschemabench.py` print the JSON for the full public sets (their --help says where to get them);
tests/data holds the samples the tests run.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from engine_core import LLM, SamplingParams
from engine_core.structured_output import StructuredOutput
from services.gateway.catalog import ServedModel, load_model
from services.gateway.errors import GatewayError
from services.gateway.schema_support import json_schema_output
from services.gateway.tool_calls import ParsedCallEnd, ParsedCallStart, Tool, ToolCallParser, ToolChoice, parse_tool

BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- BFCL ----------------------------------------------------------------------------------------------------


def bfcl_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """BFCL's parameter types as JSON Schema's."""
    out = dict(schema)
    kind = out.get("type")
    if kind == "any":
        del out["type"]
    elif kind in BFCL_TYPES:
        out["type"] = BFCL_TYPES[kind]
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: bfcl_schema(child) for name, child in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = bfcl_schema(out["items"])
    return out


def _norm(text: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def _equal(value: Any, accepted: Any) -> bool:
    if isinstance(accepted, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(accepted, bool) and value == accepted
    if isinstance(accepted, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(accepted)
    if isinstance(accepted, str) and isinstance(value, str):
        return _norm(value) == _norm(accepted)
    if isinstance(accepted, list) and isinstance(value, list):
        return len(value) == len(accepted) and all(_equal(v, a) for v, a in zip(value, accepted, strict=True))
    if isinstance(accepted, dict) and isinstance(value, dict):
        return _arguments_match(value, {k: v if isinstance(v, list) else [v] for k, v in accepted.items()})
    return bool(value == accepted)


def _arguments_match(arguments: dict[str, Any], spec: dict[str, list[Any]]) -> bool:
    if set(arguments) - set(spec):
        return False
    for name, accepted in spec.items():
        if name in arguments:
            if not any(_equal(arguments[name], a) for a in accepted if a != ""):
                return False
        elif "" not in accepted:
            return False
    return True


def bfcl_matches(calls: Sequence[tuple[str, dict[str, Any]]], ground_truth: Sequence[dict[str, Any]]) -> bool:
    """Every accepted call matched by exactly one generated call, in any order."""
    truths = [next(iter(truth.items())) for truth in ground_truth]
    if len(calls) != len(truths) or len(calls) > 8:
        return False
    return any(
        all(
            name == truth_name and _arguments_match(args, spec)
            for (name, args), (truth_name, spec) in zip(calls, order, strict=True)
        )
        for order in itertools.permutations(truths)
    )


@dataclass
class CallCheck:
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments text)
    num_valid: int = 0
    failures: list[str] = field(default_factory=list)


def check_calls(model: ServedModel, tools: Sequence[Tool], text: str) -> CallCheck:
    """Parse the output as the gateway does; count the calls that parse and validate."""
    parser = ToolCallParser(model.tool_syntax)
    events = parser.push(text) + parser.finish()
    names = [e.name for e in events if isinstance(e, ParsedCallStart)]
    ends = [e.arguments for e in events if isinstance(e, ParsedCallEnd)]
    check = CallCheck(list(zip(names, ends, strict=False)))  # a cut-off output may end inside its last call
    schemas = {tool.name: tool.parameters for tool in tools}
    if len(ends) < len(names):
        check.failures.append("a call was cut off")
    for name, arguments in check.calls:
        try:
            jsonschema.validate(json.loads(arguments), schemas[name])
            check.num_valid += 1
        except (KeyError, ValueError, jsonschema.ValidationError) as exc:
            check.failures.append(f"{name}: {str(exc)[:160]}")
    if not names:
        check.failures.append("no call")
    return check


def run_bfcl(
    data_dir: Path,
    model_name: str = "smollm2-135m",
    categories: Iterable[str] = ("simple_python", "parallel"),
    limit: int | None = None,
    max_tokens: int = 384,
    llm: LLM | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """`data_dir`: BFCL v4's data folder (BFCL_v4_<category>.json and possible_answer_BFCL_v4_<category>.json)."""
    model = load_model(model_name)
    llm = llm or LLM(model_name, device="cpu", num_kv_blocks=2048, max_num_seqs=batch_size)
    report: dict[str, Any] = {
        "model": model_name,
        "tool_format": model.tool_syntax.name,
        "max_tokens": max_tokens,
        "categories": {},
    }
    started = time.monotonic()
    for category in categories:
        questions = read_jsonl(data_dir / f"BFCL_v4_{category}.json")[:limit]
        answers = {
            a["id"]: a["ground_truth"] for a in read_jsonl(data_dir / f"possible_answer_BFCL_v4_{category}.json")
        }
        report["categories"][category] = _bfcl_category(
            model, llm, category, questions, answers, max_tokens, batch_size
        )
    report["seconds"] = round(time.monotonic() - started, 1)
    totals = list(report["categories"].values())
    report["all_calls_valid"] = all(c["all_calls_valid"] for c in totals)
    report["matched"] = sum(c["matched"] for c in totals)
    report["questions"] = sum(c["questions"] for c in totals)
    return report


def _bfcl_category(
    model: ServedModel,
    llm: LLM,
    category: str,
    questions: list[dict[str, Any]],
    answers: dict[str, Any],
    max_tokens: int,
    batch_size: int,
) -> dict[str, Any]:
    jobs, unsupported = [], []
    parallel = category.startswith("parallel")
    for question in questions:
        try:
            tools = [
                parse_tool(f["name"], f.get("description"), bfcl_schema(f["parameters"]), "tools")
                for f in question["function"]
            ]
            grammar = model.tool_syntax.grammar(
                tools, ToolChoice("required"), parallel, model.tokenizer.backend.token_to_id
            )
        except GatewayError as exc:
            unsupported.append(f"{question['id']}: {exc.message}")
            continue
        jobs.append((question, tools, model.render_chat(question["question"][0], tools), grammar))
    outputs = _generate(llm, [(prompt, grammar) for _, _, prompt, grammar in jobs], max_tokens, batch_size)
    num_calls = num_valid = matched = truncated = 0
    failures = []
    for (question, tools, _, _), (text, finish_reason) in zip(jobs, outputs, strict=True):
        check = check_calls(model, tools, text)
        truncated += finish_reason == "length"
        num_calls += len(check.calls)
        num_valid += check.num_valid
        failures += [f"{question['id']}: {failure}" for failure in check.failures]
        parsed = [(name, json.loads(args)) for name, args in check.calls[: check.num_valid]]
        matched += not check.failures and bfcl_matches(parsed, answers[question["id"]])
    return {
        "questions": len(questions),
        "unsupported": unsupported,
        "generated": len(jobs),
        "calls": num_calls,
        "valid_calls": num_valid,
        "all_calls_valid": not failures,
        "failures": failures[:20],
        "truncated": truncated,
        "matched": matched,
        "accuracy": round(matched / len(questions), 4) if questions else 0.0,
    }


def _generate(
    llm: LLM, jobs: Sequence[tuple[list[int], StructuredOutput]], max_tokens: int, batch_size: int
) -> list[tuple[str, str | None]]:
    results: list[tuple[str, str | None]] = []
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        params = [
            SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=grammar) for _, grammar in chunk
        ]
        outputs = llm.generate([prompt for prompt, _ in chunk], params)
        results += [(out.text, out.finish_reason) for out in outputs]
    return results


# ---- jsonschemabench ---------------------------------------------------------------------------------------


def _feature(message: str) -> str:
    """The feature an Unsupported message names: a keyword ('oneOf'), or format:<name>."""
    if message.startswith("the string format"):
        return "format:" + message.split('"')[1]
    match = re.search(r"'([^']+)'", message)
    return match.group(1) if match else message.split(" (at ")[0][:60]


def run_jsonschemabench(
    path: Path,
    model_name: str = "smollm2-135m",
    limit: int | None = None,
    generate: int | None = 100,
    max_tokens: int = 512,
    llm: LLM | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """`path`: Glaiveai2K as JSON Lines, one schema with its tests a line (jsonschemabench's
    maskbench/data/Glaiveai2K, one file per line). `limit` schemas are checked for support; of the supported, the
    first `generate` (None: all) are generated."""
    rows = read_jsonl(path)[:limit]
    model = load_model(model_name)
    supported, reasons = [], Counter[str]()
    started = time.monotonic()
    for row in rows:
        try:
            supported.append((row, json_schema_output(row["schema"], "schema")))
        except GatewayError as exc:
            reasons[_feature(exc.message)] += 1
    report: dict[str, Any] = {
        "model": model_name,
        "schemas": len(rows),
        "supported": len(supported),
        "supported_share": round(len(supported) / len(rows), 4) if rows else 0.0,
        "unsupported_by_feature": dict(reasons.most_common()),
    }
    chosen = supported if generate is None else supported[:generate]
    if chosen:
        llm = llm or LLM(model_name, device="cpu", num_kv_blocks=4096, max_num_seqs=batch_size)
        report.update(_generate_and_validate(model, llm, chosen, max_tokens, batch_size))
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def _generate_and_validate(
    model: ServedModel,
    llm: LLM,
    chosen: list[tuple[dict[str, Any], StructuredOutput]],
    max_tokens: int,
    batch_size: int,
) -> dict[str, Any]:
    jobs, skipped = [], 0
    for row, grammar in chosen:
        prompt = model.render_chat(
            [
                {"role": "system", "content": "You answer with JSON only."},
                {
                    "role": "user",
                    "content": f"Give an example JSON value for this JSON Schema:\n{json.dumps(row['schema'])}",
                },
            ]
        )
        if len(prompt) + max_tokens > llm.engine.max_model_len:
            skipped += 1
            continue
        jobs.append((row, prompt, grammar))
    outputs = _generate(llm, [(prompt, grammar) for _, prompt, grammar in jobs], max_tokens, batch_size)
    completed = valid = 0
    invalid, truncated = [], 0
    for (row, _, _), (text, finish_reason) in zip(jobs, outputs, strict=True):
        if finish_reason == "length":
            truncated += 1  # cut off by max_tokens: a prefix of a valid output, not judged
            continue
        completed += 1
        try:
            validator = jsonschema.validators.validator_for(row["schema"])
            validator(row["schema"], format_checker=validator.FORMAT_CHECKER).validate(json.loads(text))
            valid += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            invalid.append({"file": row["file"], "output": text[:200], "error": str(exc)[:200]})
    return {
        "generated": len(jobs),
        "skipped_too_long": skipped,
        "completed": completed,
        "truncated": truncated,
        "valid": valid,
        "all_completed_valid": not invalid,
        "invalid": invalid[:20],
        "max_tokens": max_tokens,
    }
