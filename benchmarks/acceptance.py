"""Acceptance length (emitted tokens / verify steps, greedy) per workload of every drafter for the embedded
SmolLM2-135M target: DSPARK as shipped (n-gram hybrid), DSPARK's drafter alone, NGRAM, and the DSPARK / DFLASH /
EAGLE drafters trained for comparison on the same data and CPU time (benchmarks/drafters/). Block windows are
verified in full (confidence threshold 0), so the numbers say how far each drafter's guesses hold, not how the
budget planner trades them against batch cost (benchmarks/batch_sweep.py measures that). Plain decoding runs too:
every greedy text must match it.

    python benchmarks/acceptance.py                      # 30 prompts per workload, 256 new tokens

Each configuration's results are kept under --cells-dir as it finishes; `--resume` reuses those made with
the same settings, so an interrupted run (or one that adds a drafter) redoes only what is missing.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_result  # noqa: E402
from specserve.bench.run import build_record, format_table, plot, run_algorithm  # noqa: E402
from specserve.datasets import WORKLOADS, load_workload, messages, select_prompts  # noqa: E402
from specserve.drafters import EMBEDDED_DSPARK  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402

BLOCK = 8
# DSPARK, DFLASH and EAGLE drafters trained from scratch on the same data, features and CPU time, for comparison
COMPARISON = Path(__file__).resolve().parent / "drafters"


def weights_digest(folder: str) -> str:
    """A drafter folder's config and weights, so that --resume never reuses the cells of a drafter retrained in
    place."""
    digest = hashlib.sha1()
    for name in ("config.json", "model.safetensors"):
        with open(Path(folder) / name, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha1").digest())
    return digest.hexdigest()


def configurations(args: argparse.Namespace) -> dict[str, dict]:
    """Label → engine arguments."""
    dspark = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": args.dspark,
              "speculative_block_size": BLOCK, "speculative_dspark_confidence_threshold": 0.0}
    configs = {"none": {}, "dspark": {**dspark, "speculative_ngram_hybrid": True}, "dspark_pure": dspark,
               "ngram": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": BLOCK}}
    if args.dspark_matched:
        configs["dspark_matched"] = {**dspark, "speculative_draft_model_path": args.dspark_matched}
    if args.dflash:
        configs["dflash"] = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": args.dflash,
                             "speculative_block_size": BLOCK}
    if args.eagle:
        configs["eagle"] = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": args.eagle,
                            "speculative_num_draft_tokens": BLOCK}
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dspark", default=str(EMBEDDED_DSPARK), help="DSPARK drafter folder")
    for algorithm, flag in (("dspark", "--dspark-matched"), ("dflash", "--dflash"), ("eagle", "--eagle")):
        folder = COMPARISON / f"smollm2-135m-{algorithm}"
        parser.add_argument(flag, default=str(folder) if folder.is_dir() else None,
                            help=f"comparison {algorithm.upper()} drafter folder (default: "
                                 f"{folder.relative_to(COMPARISON.parent.parent)} if present; skipped if none)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (speed only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cells-dir", default=str(RESULTS / ".acceptance-cells"),
                        help="where each configuration's results are kept as it finishes")
    parser.add_argument("--resume", action="store_true",
                        help="reuse configurations finished under --cells-dir with the same settings")
    args = parser.parse_args()
    cells_dir = Path(args.cells_dir)
    cells_dir.mkdir(parents=True, exist_ok=True)

    loaded = {name: load_workload(name) for name in args.workloads.split(",")}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    workloads, cells = None, {}
    for label, engine_args in configurations(args).items():
        drafter = engine_args.get("speculative_draft_model_path")
        settings = json.dumps({"engine": engine_args, "drafter": drafter and weights_digest(drafter),
                               "workloads": args.workloads, "num_prompts": args.num_prompts,
                               "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
                               "batch_size": args.batch_size, "threads": args.threads}, sort_keys=True)
        saved = cells_dir / f"{label}.pkl"
        if args.resume and saved.is_file():
            kept_settings, kept_cells = pickle.loads(saved.read_bytes())
            if kept_settings == settings:
                print(f"{label}: reusing {saved}")
                cells[label] = kept_cells
                continue
        llm = LLM(num_threads=args.threads, max_running_requests=args.batch_size, **engine_args)
        workloads = workloads or select_prompts(llm.tokenizer, loaded, args.num_prompts, args.max_prompt_tokens)
        llm.generate([chat_token_ids(llm.tokenizer, messages(next(iter(workloads.values()))[0], []))],
                     SamplingParams(max_new_tokens=4, temperature=0.0))
        cells[label] = run_algorithm(llm, label, workloads, params, args.batch_size)
        saved.write_bytes(pickle.dumps((settings, cells[label])))
        del llm
        gc.collect()

    record = build_record(cells, greedy=True, config=vars(args), skipped={})
    print(format_table(record))
    s = record["summary"]

    def macro(label: str) -> float | None:
        return s[label]["accept_length"] if label in s else None

    summary = {f"{label}_macro_accept_length": macro(label) for label in ("dspark", "dspark_pure", "dspark_matched",
                                                                         "dflash", "eagle", "ngram")}
    summary["dspark_vs_ngram"] = round(macro("dspark") / macro("ngram"), 3)
    for dspark in ("dspark_pure", "dspark_matched"):
        for other in ("dflash", "eagle"):
            if macro(dspark) and macro(other):
                summary[f"{dspark}_vs_{other}"] = round(macro(dspark) / macro(other), 3)
    summary["text_differs"] = sum(s[label].get("text_differs", 0) for label in s)
    plot(record, RESULTS / "acceptance.png")
    path = write_result("acceptance", summary, {"per_algorithm": s, "results": record["results"],
                                                "config": record["config"]})
    print(summary)
    print(f"wrote {path} and {RESULTS / 'acceptance.png'}")


if __name__ == "__main__":
    main()
