"""`kvmesh` — one entry point for models, benchmarks and (later) the mesh's roles.

kvmesh models list                  known models and whether they are on disk
kvmesh models pull [NAME ...]       fetch real weights (smollm2-135m), write deepseek-tiny and deepseek-v4-tiny
                                    (default: the known models in $KVMESH_MODELS, else all)
kvmesh models make-tiny             write deepseek-tiny (random weights, fixed seed)
kvmesh generate MODEL PROMPT        one completion, offline
kvmesh up [--prefill N] [--decode N] [--balancer N] [--gateway N] ...   the whole mesh here, supervised
kvmesh certs init DIR               a CA and one certificate per role (mutual TLS between roles: KVMESH_TLS_DIR)
    [--worker ROLE/NAME ...]        and per named worker, with a NATS user that speaks only as NAME
kvmesh serve ROLE                   one role (gateway, encoder, prefill, decode, kvcache, balancer, expert_lb),
                                    configured by KVMESH_*
kvmesh bench engine --json          engine throughput against transformers
kvmesh bench sampler --json         sampling's cost per decode step, per setting, on real logits
kvmesh bench quant --json           int8 against our float32: greedy agreement, perplexity, tokens/s
kvmesh bench long-prompt --json     running streams' TPOT p99 while long prompts arrive, fixed and priced caps
kvmesh bench kvcache --trace F      replay a Mooncake trace through the KV store (also kv-transfer, kv-ttft)
kvmesh bench expert --json          expert placement on skewed, drifting loads, against DeepSeek EPLB
kvmesh bench route --trace F --policy all   routing policies side by side in the trace-driven simulator
kvmesh bench admission --json       tenant limits: admission + settlement cost and decisions/s, 1 and 3 replicas
kvmesh bench scale --gpus N --json  size an N-GPU deployment from the seed's figures and measured costs
kvmesh bench soak --minutes 5 --json   mixed traffic for minutes: errors, latency over time, memory slopes
kvmesh bench faults --json          kill, stop and slow each role under load: failed requests, recovery time
kvmesh eval run --workload F --output R.json   replay a workload against a mesh: latency, cost, quality
kvmesh eval compare BASELINE RESULT   the regression gate: exit 0 ok, 1 regressed, 2 bad input
kvmesh expert-plan --input FILE     an expert placement planned offline from a load matrix (JSON)
kvmesh config --markdown            docs/configuration.md from the settings (--metrics-markdown: docs/metrics.md)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING

from engine_core import model_store

if TYPE_CHECKING:
    from kvmesh.up import Mesh, MeshPlan


def _models(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        for name, known in model_store.KNOWN_MODELS.items():
            state = "present" if model_store.is_present(name) else "absent"
            print(f"{name:15} {state:8} {known.description}  [{model_store.model_path(name)}]")
        return 0
    names = ["deepseek-tiny"] if args.models_command == "make-tiny" else (args.names or _default_pulls())
    for name in names:
        if name == "deepseek-tiny" and args.models_command == "make-tiny" and args.force:
            from engine_core.tiny import write_deepseek_tiny

            write_deepseek_tiny(model_store.model_dir() / name)
        path = model_store.ensure(name, progress=sys.stderr.isatty())
        print(f"{name}: {path}")
    return 0


def _default_pulls() -> list[str]:
    """The known models named in KVMESH_MODELS (what the roles will serve; paths need no pull), else all."""
    configured = [m.strip() for m in os.environ.get("KVMESH_MODELS", "").split(",") if m.strip()]
    known = [m for m in configured if m in model_store.KNOWN_MODELS]
    return known if configured else list(model_store.KNOWN_MODELS)


def _generate(args: argparse.Namespace) -> int:
    from engine_core import LLM, SamplingParams

    llm = LLM(args.model, device=args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


ROLES = ("gateway", "encoder", "prefill", "decode", "kvcache", "balancer", "expert_lb")


def _config(args: argparse.Namespace) -> int:
    from kvmesh.config_docs import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(f"services.{args.role}.__main__").main()
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvmesh.up import Mesh, MeshPlan

    for model in args.models:
        if model in model_store.KNOWN_MODELS:
            model_store.ensure(model, progress=sys.stderr.isatty())
    plan = MeshPlan(
        prefill=args.prefill,
        decode=args.decode,
        kvcache=args.kvcache,
        balancer=args.balancer,
        gateway=args.gateway,
        encoder=args.encoder,
        models=tuple(args.models),
        http_port=args.port,
        grpc_port=args.grpc_port,
        nats_url=args.nats,
        nats_cluster=args.nats_cluster,
    )
    with contextlib.ExitStack() as stack:
        mesh = _netns_mesh(plan, stack) if args.netns else Mesh(plan)
        return _run_mesh(mesh, plan)


def _netns_mesh(plan: MeshPlan, stack: contextlib.ExitStack) -> Mesh:
    """`kvmesh up --netns`: every child a host of its own (kvmesh.netns), removed again when the mesh stops."""
    from kvmesh.netns import Hosts, NetnsMesh, unavailable

    reason = unavailable()
    if reason is not None:
        raise ValueError(f"--netns: {reason}")
    hosts = stack.enter_context(Hosts())
    mesh = NetnsMesh(hosts, plan)
    for name, host in hosts.hosts.items():
        print(f"netns: {name} on {host.address} (namespace {host.namespace})", file=sys.stderr)
    print(f"netns: NATS and this shell on {hosts.address} (bridge {hosts.bridge})", file=sys.stderr)
    return mesh


def _run_mesh(mesh: Mesh, plan: MeshPlan) -> int:
    try:
        mesh.start()
        mesh.wait_ready()
        key = mesh.api_keys[0]
        origin = "generated for this run" if mesh.generated_key else "from KVMESH_API_KEYS"
        print(
            f"\nkvmesh is up: {mesh.base_url}  (gRPC on :{plan.grpc_port})\n"
            f"API key ({origin}): {key}\n"
            f"Admin key ({'generated for this run' if mesh.is_admin_key_generated else 'from KVMESH_ADMIN_KEY'}): "
            f"{mesh.admin_key}  (/admin/v1/ and `kvmesh admin`: tenants, keys, prices)\n"
            f"  curl {mesh.base_url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            "-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{plan.models[0]}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\'\n'
            "Ctrl-C stops everything.\n",
            file=sys.stderr,
            flush=True,
        )
        mesh.run_forever()
    finally:
        mesh.stop()
    return 0


def _admin(args: argparse.Namespace) -> int:
    from kvmesh.admin_cli import run

    return run(args)


def _certs(args: argparse.Namespace) -> int:
    from kvmesh.certs import run

    return run(args)


def _eval(args: argparse.Namespace) -> int:
    from kvmesh.eval.cli import run_command

    return run_command(args)


def _expert_plan(args: argparse.Namespace) -> int:
    from kvmesh.expert_plan import run

    result = run(args.input, args.policy, args.max_moves, args.replan_gain)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvmesh.bench.kv_cli import COMMANDS as KV_BENCHES

    if args.bench_command in KV_BENCHES:
        from kvmesh.bench.kv_cli import run

        return run(args)
    if args.bench_command == "route":
        from kvmesh.bench.route_cli import run as run_route

        return run_route(args)
    if args.bench_command == "admission":
        from kvmesh.bench.admission import run as run_admission

        return run_admission(args)
    if args.bench_command == "scale":
        from kvmesh.bench.scale import run as run_scale

        return run_scale(args)
    if args.bench_command == "netns":
        from kvmesh.bench.netns_bench import run as run_netns

        return run_netns(args)
    if args.bench_command == "soak":
        from kvmesh.bench.soak import run as run_soak

        return run_soak(args)
    if args.bench_command == "faults":
        from kvmesh.bench.fault_run import run as run_faults

        return run_faults(args)
    if args.bench_command == "expert":
        from kvmesh.bench.expert import run_expert_bench

        result = run_expert_bench(quick=args.quick, seed=args.seed)
    elif args.bench_command == "sampler":
        from kvmesh.bench.sampler import run as run_sampler

        result = run_sampler(args)
    elif args.bench_command == "spans":
        from kvmesh.bench.spans import run_span_bench

        result = run_span_bench(args.spans, args.repeats)
    elif args.bench_command == "engine":
        from kvmesh.bench.engine import run_engine_bench

        result = run_engine_bench(
            args.model,
            args.concurrency,
            args.device,
            args.seed,
            quick=args.quick,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            repeats=args.repeats,
            sampling=args.sampling,
            quantization=args.quantization,
            cpu_decode_kernel=args.cpu_decode_kernel,
            with_llama_cpp=args.with_llama_cpp,
            llama_server=args.llama_server,
        )
    elif args.bench_command == "quant":
        from kvmesh.bench.quant import run_quant_bench

        result = run_quant_bench(args.model, args.concurrency, args.repeats, args.seed, args.greedy_tokens)
    elif args.bench_command == "long-prompt":
        from kvmesh.bench.long_prompt import run_long_prompt_bench

        result = run_long_prompt_bench(
            args.model,
            args.streams,
            args.prompt_tokens,
            args.thresholds,
            args.max_num_batched_tokens,
            args.seed,
            args.step_ratios,
            args.rounds,
        )
    elif args.bench_command == "serve" and args.trace_rounds:
        from kvmesh.bench.trace_ab import run_trace_ab

        result = run_trace_ab(
            args.concurrency, args.requests, args.model, args.prompt_words, args.max_tokens, args.trace_rounds
        )
    else:
        from kvmesh.bench.serve import run_serve_bench

        if len(args.concurrency) != 1:
            raise SystemExit("kvmesh bench serve: one --concurrency, unless --trace-rounds")
        result = run_serve_bench(
            args.concurrency[0],
            args.requests,
            args.model,
            args.prompt_words,
            args.max_tokens,
            url=args.url,
            seed=args.seed,
            api_key=args.api_key,
            trace=args.trace,
            baseline=not args.no_baseline,
        )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="list, pull and make models")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    models_commands.add_parser("list", help="known models and whether they are on disk")
    pull = models_commands.add_parser("pull", help="fetch known models (default: those in $KVMESH_MODELS, else all)")
    pull.add_argument("names", nargs="*", metavar="NAME", help=", ".join(model_store.KNOWN_MODELS))
    tiny = models_commands.add_parser("make-tiny", help="write the deepseek-tiny model directory")
    tiny.add_argument("--force", action="store_true", help="rewrite it even if present")

    generate = commands.add_parser("generate", help="generate one completion offline")
    generate.add_argument("model")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--device", default="auto")

    up = commands.add_parser("up", help="run the whole mesh locally (embedded NATS, every role a child process)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--kvcache", type=int, default=1, help="KV store nodes")
    up.add_argument("--balancer", type=int, default=2, help="balancer replicas (they share their decisions)")
    up.add_argument("--gateway", type=int, default=1, help="gateway processes sharing --port (SO_REUSEPORT)")
    up.add_argument("--encoder", type=int, default=1, help="vision encoder workers (0: images are refused)")
    up.add_argument("--models", nargs="+", default=list(model_store.DEFAULT_MODELS))
    up.add_argument("--port", type=int, default=8080, help="the gateway's HTTP port")
    up.add_argument("--grpc-port", type=int, default=50050, help="the gateway's gRPC port")
    up.add_argument("--nats", default=None, metavar="URL", help="use this NATS instead of an embedded one")
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="run the embedded NATS as a cluster of N nodes (3 or more), JetStream replicas 3 (docs/reliability.md)",
    )
    up.add_argument(
        "--netns",
        action="store_true",
        help="every child in a network namespace of its own on a bridge, its own address (root; docs/scale.md)",
    )

    serve = commands.add_parser("serve", help="run one role in the foreground (configured by KVMESH_* variables)")
    serve.add_argument("role", choices=ROLES)
    from kvmesh.config_docs import add_parser as add_config_parser

    add_config_parser(commands)
    from kvmesh.admin_cli import add_parser as add_admin_parser

    add_admin_parser(commands)
    from kvmesh.certs import add_parser as add_certs_parser

    add_certs_parser(commands)
    from kvmesh.eval.cli import add_parser as add_eval_parser

    add_eval_parser(commands)

    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from kvmesh.bench.kv_cli import add_parsers as add_kv_bench_parsers  # kvcache, kv-transfer, kv-ttft, kv-index

    add_kv_bench_parsers(bench_commands)
    from kvmesh.bench.route_cli import add_parser as add_route_bench_parser

    add_route_bench_parser(bench_commands)
    from kvmesh.bench.admission import add_parser as add_admission_bench_parser

    add_admission_bench_parser(bench_commands)
    from kvmesh.bench.scale import add_parser as add_scale_bench_parser

    add_scale_bench_parser(bench_commands)
    from kvmesh.bench.fault_run import add_parser as add_faults_bench_parser
    from kvmesh.bench.soak import add_parser as add_soak_bench_parser

    add_soak_bench_parser(bench_commands)
    add_faults_bench_parser(bench_commands)
    from kvmesh.bench.netns_bench import add_parser as add_netns_bench_parser

    add_netns_bench_parser(bench_commands)
    serve_bench = bench_commands.add_parser("serve", help="the mesh under load through its REST API")
    serve_bench.add_argument(
        "--concurrency", type=int, nargs="+", default=[4], help="requests in flight (several: with --trace-rounds)"
    )
    serve_bench.add_argument("--requests", type=int, default=32)
    serve_bench.add_argument("--model", default="smollm2-135m")
    serve_bench.add_argument("--prompt-words", type=int, default=64, help="words per prompt (plus a short preamble)")
    serve_bench.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (EOS ignored)")
    serve_bench.add_argument("--url", default=None, help="an already running gateway (default: start a mesh)")
    serve_bench.add_argument(
        "--api-key",
        default=os.environ.get("KVMESH_API_KEY"),
        help="the gateway's API key (default: $KVMESH_API_KEY, else the key of the mesh started here)",
    )
    serve_bench.add_argument("--seed", type=int, default=0)
    serve_bench.add_argument(
        "--trace", action="store_true", help="tracing on in the mesh started here, exported to a receiver in the bench"
    )
    serve_bench.add_argument(
        "--trace-rounds",
        type=int,
        default=0,
        help="price tracing: two meshes, tracing off and on, this many interleaved rounds of --requests each "
        "(medians and paired differences; bench/trace_ab.py)",
    )
    serve_bench.add_argument("--no-baseline", action="store_true", help="skip the in-process engine run")
    serve_bench.add_argument("--json", action="store_true", help="one line of JSON")

    engine = bench_commands.add_parser("engine", help="engine prefill/decode tokens/s against transformers")
    engine.add_argument("--model", default="smollm2-135m")
    engine.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 8 32 (--quick: 1 4)")
    engine.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt lengths up to this (default 256)")
    engine.add_argument("--max-output-tokens", type=int, default=None, help="output lengths up to this (default 64)")
    engine.add_argument("--repeats", type=int, default=None, help="runs per measurement, median reported (default 3)")
    engine.add_argument("--quick", action="store_true", help="smoke test: C 1 4, short lengths, 1 repeat")
    engine.add_argument("--device", default="cpu")
    engine.add_argument(
        "--sampling",
        choices=("greedy", "typical"),
        default="greedy",
        help="typical: temperature 0.8, top_p 0.95, top_k 50, repetition_penalty 1.1 (default greedy)",
    )
    engine.add_argument("--quantization", default="none", help="the engine's quantization mode (default none)")
    engine.add_argument(
        "--cpu-decode-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our engine's decode attention by the C++ kernel over the paged cache (KVMESH_CPU_DECODE_KERNEL; "
        "default on, --no-cpu-decode-kernel: gather + SDPA)",
    )
    engine.add_argument(
        "--with-llama-cpp",
        action="store_true",
        help="also llama.cpp's server on the same GGUF: llama-server (from PATH or --llama-server) with parallel "
        "slots = concurrency, else llama-cpp-python[server]; skipped with a message if neither is there",
    )
    engine.add_argument(
        "--llama-server",
        metavar="PATH",
        default=None,
        help="llama.cpp's llama-server binary for the side-by-side (implies --with-llama-cpp)",
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--json", action="store_true", help="one line of JSON")

    quant = bench_commands.add_parser("quant", help="int8 against our float32: greedy agreement, perplexity, tokens/s")
    quant.add_argument("--model", default="smollm2-135m")
    quant.add_argument("--concurrency", type=int, default=32, help="requests submitted at once (default 32)")
    quant.add_argument("--repeats", type=int, default=3, help="runs per engine, interleaved, median reported")
    quant.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens per prompt compared")
    quant.add_argument("--seed", type=int, default=0)
    quant.add_argument("--json", action="store_true", help="one line of JSON")

    long_prompt = bench_commands.add_parser(
        "long-prompt", help="running streams' TPOT p99 while long prompts arrive, per prefill cap"
    )
    long_prompt.add_argument("--model", default="smollm2-135m")
    long_prompt.add_argument("--streams", type=int, default=8, help="requests decoding when the long prompt comes")
    long_prompt.add_argument("--prompt-tokens", type=int, default=8000, help="the long prompt's length")
    long_prompt.add_argument(
        "--thresholds", type=int, nargs="+", default=[256], help="long_prefill_token_threshold values (0: off)"
    )
    long_prompt.add_argument(
        "--step-ratios",
        type=float,
        nargs="+",
        default=[0.0, 1.5],
        help="long_prefill_step_ratio values, each run with every threshold (0: off, the token cap alone)",
    )
    long_prompt.add_argument("--rounds", type=int, default=1, help="rounds of every arm, alternated; medians kept")
    long_prompt.add_argument("--max-num-batched-tokens", type=int, default=2048)
    long_prompt.add_argument("--seed", type=int, default=0)
    long_prompt.add_argument("--json", action="store_true", help="one line of JSON")

    from kvmesh.bench.sampler import add_parser as add_sampler_bench_parser

    add_sampler_bench_parser(bench_commands)
    spans = bench_commands.add_parser("spans", help="CPU time of one span, tracing off and on, and its OTLP encoding")
    spans.add_argument("--spans", type=int, default=5000, help="spans per measurement")
    spans.add_argument("--repeats", type=int, default=5, help="measurements, median reported")
    spans.add_argument("--json", action="store_true", help="one line of JSON")

    expert = bench_commands.add_parser("expert", help="expert placement on drifting skewed loads vs DeepSeek EPLB")
    expert.add_argument("--quick", action="store_true", help="smoke test: fewer layers and intervals")
    expert.add_argument("--seed", type=int, default=0)
    expert.add_argument("--json", action="store_true", help="one line of JSON")

    expert_plan = commands.add_parser("expert-plan", help="plan an expert placement offline from a load matrix")
    expert_plan.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="JSON: weight, num_replicas, num_groups, num_nodes, num_gpus (top level or under "
        "`inputs`), optionally the current phy2log",
    )
    expert_plan.add_argument("--policy", default="auto", choices=("auto", "hierarchical", "global"))
    expert_plan.add_argument(
        "--max-moves", type=int, default=None, help="change at most this many slots per layer of the current placement"
    )
    expert_plan.add_argument(
        "--replan-gain",
        type=float,
        default=1.0,
        help="with --max-moves: a full plan when it beats the limited one by more (default: never)",
    )
    expert_plan.add_argument("--json", action="store_true", help="one line of JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "models": _models,
        "generate": _generate,
        "up": _up,
        "serve": _serve,
        "config": _config,
        "bench": _bench,
        "expert-plan": _expert_plan,
        "admin": _admin,
        "certs": _certs,
        "eval": _eval,
    }
    try:
        return handlers[args.command](args)
    except ValueError as exc:  # ConfigError, PromptError, SamplingParamsError: the message names the problem
        print(f"kvmesh: error: {exc}", file=sys.stderr)
        return 2
