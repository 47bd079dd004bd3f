"""`specserve bench`: acceptance length and speed of each speculative algorithm over the workload suite,
measured one algorithm after another in one run, against plain decoding (algorithm `none`)."""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.config import engine_kwargs
from specserve.datasets import WORKLOADS, Conversation, load_workload, messages, parse_workload_file, select_prompts
from specserve.engine import LLM
from specserve.loader.tokenizer import chat_token_ids
from specserve.types import SamplingParams, SpecStats

log = logging.getLogger(__name__)

ALGORITHMS = ("none", "ngram", "standalone", "eagle", "dflash", "dspark")
DRAFTER_ALGORITHMS = ("standalone", "eagle", "dflash", "dspark")


@dataclass
class Cell:
    """One algorithm on one workload: pooled statistics, generation seconds, and each conversation's answers."""
    stats: SpecStats = field(default_factory=SpecStats)
    seconds: float = 0.0
    answers: list[tuple[str, ...]] = field(default_factory=list)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--algorithms", default=",".join(ALGORITHMS),
      help="comma-separated, run one after another (replaces --speculative-algorithm); "
           "`none` is the baseline for speedup and the text check")
    a("--workloads", default=None,
      help=f"comma-separated from {','.join(WORKLOADS)} (default: all of them, or none with --workload-file)")
    a("--workload-file", action="append", default=[],
      help='JSONL of {"prompt": ...} or {"turns": [...]} lines, a workload named after the file (repeatable)')
    a("--num-prompts", type=int, default=10, help="prompts per workload (the first ones that fit)")
    a("--max-new-tokens", type=int, default=256, help="per turn")
    a("--max-prompt-tokens", type=int, default=1024,
      help="prompts longer than this after the chat template are passed over, the same for every algorithm")
    a("--batch-size", type=int, default=1, help="prompts submitted together")
    a("--temperature", type=float, default=0.0, help="0 = greedy: every algorithm's text must then match none's")
    a("--json", default=None, help="write the results to this JSON file")
    a("--plot", default=None, help="write a PNG: acceptance length per workload, acceptance rate per position")
    for algorithm in DRAFTER_ALGORITHMS:
        a(f"--draft-model-path-{algorithm}", default=None,
          help=f"drafter for {algorithm} (default: --speculative-draft-model-path if no other listed algorithm "
               "needs a drafter)")


def drafter_paths(algorithms: list[str], own: dict[str, str | None], shared: str | None) -> dict[str, str | None]:
    """Each drafter algorithm's own path; the shared --speculative-draft-model-path fills in when exactly one
    listed algorithm lacks one, since a drafter fits only its own algorithm."""
    missing = [a for a in algorithms if a in DRAFTER_ALGORITHMS and not own.get(a)]
    if shared and len(missing) > 1:
        raise ValueError(f"--speculative-draft-model-path is ambiguous for {', '.join(missing)}: "
                         f"give each its --draft-model-path-<algorithm>")
    return {a: own.get(a) or shared for a in algorithms if a in DRAFTER_ALGORITHMS}


def run_batch(llm: LLM, batch: list[Conversation], params: SamplingParams, cell: Cell) -> None:
    """Turn by turn: every conversation still going asks its next turn after its own previous answers."""
    answers: list[list[str]] = [[] for _ in batch]
    for turn in range(max(map(len, batch))):
        live = [i for i, turns in enumerate(batch) if len(turns) > turn]
        prompts = [chat_token_ids(llm.tokenizer, messages(batch[i], answers[i])) for i in live]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        cell.seconds += time.perf_counter() - start
        for i, out in zip(live, outs):
            answers[i].append(out.text)
            cell.stats.merge(out.spec)
    cell.answers += map(tuple, answers)


def run_algorithm(llm: LLM, algorithm: str, workloads: dict[str, list[Conversation]], params: SamplingParams,
                  batch_size: int) -> dict[str, Cell]:
    cells = {}
    with tqdm(total=sum(map(len, workloads.values())), desc=algorithm, unit="prompt") as bar:
        for name, conversations in workloads.items():
            bar.set_postfix_str(name)
            cell = cells[name] = Cell()
            for i in range(0, len(conversations), batch_size):
                batch = conversations[i:i + batch_size]
                run_batch(llm, batch, params, cell)
                bar.update(len(batch))
    return cells


def acceptance_by_position(histogram: list[int]) -> list[float]:
    """Row k: the share of verify steps that accepted draft k among those that accepted drafts 1..k-1.
    A step that proposed fewer than k drafts counts as not accepting draft k."""
    reached = [sum(histogram[k:]) for k in range(len(histogram))]     # steps that accepted >= k drafts
    return [round(reached[k] / reached[k - 1], 4) for k in range(1, len(histogram))]


def rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 2)


def speedup(row: dict, plain: dict) -> float:
    return round(row["tokens_per_s"] / plain["tokens_per_s"], 3)


def workload_row(cell: Cell) -> dict:
    s = cell.stats
    return {**s.as_dict(), "acceptance_by_position": acceptance_by_position(s.accepted_histogram),
            "prompts": len(cell.answers), "tokens": s.num_emitted_tokens, "seconds": round(cell.seconds, 3),
            "tokens_per_s": rate(s.num_emitted_tokens, cell.seconds)}


def build_record(cells: dict[str, dict[str, Cell]], greedy: bool, config: dict, skipped: dict[str, str]) -> dict:
    """The JSON record: per algorithm and workload the pooled statistics; per algorithm a summary (macro-mean
    acceptance length, tokens/s); when `none` ran, speedups against it and, greedy, prompts whose text differs."""
    results = {a: {w: workload_row(cell) for w, cell in by_workload.items()} for a, by_workload in cells.items()}
    summary = {}
    for algorithm, rows in results.items():
        pooled = SpecStats()
        for cell in cells[algorithm].values():
            pooled.merge(cell.stats)
        summary[algorithm] = {
            "accept_length": round(sum(r["accept_length"] for r in rows.values()) / len(rows), 4),
            "acceptance_by_position": acceptance_by_position(pooled.accepted_histogram),
            "tokens_per_s": rate(pooled.num_emitted_tokens, sum(c.seconds for c in cells[algorithm].values()))}
    if "none" in cells:
        for algorithm, rows in results.items():
            summary[algorithm]["speedup_vs_none"] = speedup(summary[algorithm], summary["none"])
            for name, row in rows.items():
                row["speedup_vs_none"] = speedup(row, results["none"][name])
                if greedy and algorithm != "none":
                    row["text_differs"] = sum(a != b for a, b in zip(cells[algorithm][name].answers,
                                                                     cells["none"][name].answers))
            if greedy and algorithm != "none":
                differs = sum(r["text_differs"] for r in rows.values())
                prompts = sum(r["prompts"] for r in rows.values())
                summary[algorithm] |= {"text_differs": differs, "text_differs_rate": round(differs / prompts, 4)}
    machine = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    return {"summary": summary, "results": results, "skipped": skipped, "config": config, "machine": machine}


def format_table(record: dict) -> str:
    """Rows = workloads, columns = algorithms, cells = acceptance length; then the macro mean, tokens/s,
    speedup vs none, and (greedy) prompts whose text differs from none's."""
    summary, results = record["summary"], record["results"]
    algorithms = list(results)
    workloads = list(results[algorithms[0]])
    prompts = {a: sum(r["prompts"] for r in results[a].values()) for a in algorithms}

    def row(label: str, key: str, fmt) -> list[str]:
        return [label, *(fmt(summary[a][key], a) if key in summary[a] else "-" for a in algorithms)]

    rows = [["acceptance length", *algorithms], None]
    rows += [[w, *(f"{results[a][w]['accept_length']:.2f}" for a in algorithms)] for w in workloads]
    rows += [None, row("macro mean", "accept_length", lambda v, a: f"{v:.2f}"),
             row("tokens/s", "tokens_per_s", lambda v, a: f"{v:.1f}")]
    if "none" in summary:
        rows.append(row("speedup vs none", "speedup_vs_none", lambda v, a: f"{v:.2f}x"))
    if any("text_differs" in s for s in summary.values()):
        rows.append(row("text differs", "text_differs", lambda v, a: f"{v}/{prompts[a]}"))
    cols = [r for r in rows if r is not None]
    widths = [max(len(r[i]) for r in cols) for i in range(len(cols[0]))]
    lines = ["-" * (sum(widths) + 2 * len(algorithms)) if r is None else
             "  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:]))]) for r in rows]
    lines += [f"skipped {a}: {why}" for a, why in record["skipped"].items()]
    return "\n".join(lines)


def plot(record: dict, path: str | Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: works without a display backend
    from matplotlib.ticker import MaxNLocator

    results, summary = record["results"], record["summary"]
    algorithms = list(results)
    workloads = list(results[algorithms[0]])
    fig = Figure(figsize=(12, 4.5))
    bars, rates = fig.subplots(1, 2)
    width = 0.8 / len(algorithms)
    for j, algorithm in enumerate(algorithms):
        bars.bar([i + j * width for i in range(len(workloads))],
                 [results[algorithm][w]["accept_length"] for w in workloads], width, label=algorithm)
        if by_position := summary[algorithm]["acceptance_by_position"]:
            rates.plot(range(1, len(by_position) + 1), by_position, marker="o", label=algorithm)
    bars.set_xticks([i + (len(algorithms) - 1) * width / 2 for i in range(len(workloads))], workloads)
    bars.set_ylabel("acceptance length (tokens per verify step)")
    bars.legend()
    rates.set_xlabel("draft position k")
    rates.xaxis.set_major_locator(MaxNLocator(integer=True))
    rates.set_ylabel("P(draft k accepted | drafts 1..k-1 were)")
    rates.set_ylim(0, 1.05)
    if rates.lines:
        rates.legend()
    fig.tight_layout()
    fig.savefig(path)


def names(value: str, allowed: Collection[str], flag: str) -> list[str]:
    chosen = [n.strip().lower() for n in value.split(",") if n.strip()]
    if unknown := [n for n in chosen if n not in allowed]:
        raise ValueError(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return chosen


def run_bench(args: argparse.Namespace) -> int:
    algorithms = names(args.algorithms, ALGORITHMS, "--algorithms")
    default_workloads = "" if args.workload_file else ",".join(WORKLOADS)
    workload_names = names(args.workloads if args.workloads is not None else default_workloads, WORKLOADS,
                           "--workloads")
    if args.num_prompts < 1 or args.batch_size < 1:
        raise ValueError("--num-prompts and --batch-size must be >= 1")
    own = {a: getattr(args, f"draft_model_path_{a}") for a in DRAFTER_ALGORITHMS}
    drafters = drafter_paths(algorithms, own, args.speculative_draft_model_path)
    skipped = {a: f"no drafter given (--draft-model-path-{a})" for a, path in drafters.items() if not path}
    for algorithm, why in skipped.items():
        log.warning("skipping %s: %s", algorithm, why)
    runnable = [a for a in algorithms if a not in skipped]
    if not runnable:
        raise ValueError("no algorithm left to run: give the drafters' paths or add none/ngram to --algorithms")
    loaded = {n: load_workload(n) for n in workload_names} | {
        Path(f).stem: parse_workload_file(f) for f in args.workload_file}
    if not loaded:
        raise ValueError("no workloads: pass --workloads or --workload-file")

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    workloads = None
    cells = {}
    for algorithm in runnable:
        llm = LLM(**{**engine_kwargs(args), "speculative_algorithm": algorithm.upper(),
                     "speculative_draft_model_path": drafters.get(algorithm)})
        # Picked once with the target's tokenizer, so that every algorithm answers the same prompts.
        max_tokens = min(args.max_prompt_tokens, llm.engine.max_model_len - 1)
        workloads = workloads or select_prompts(llm.tokenizer, loaded, args.num_prompts, max_tokens)
        warm_up = chat_token_ids(llm.tokenizer, messages(next(iter(workloads.values()))[0], []))
        llm.generate([warm_up], SamplingParams(max_new_tokens=4, temperature=0.0))   # first-call costs untimed
        cells[algorithm] = run_algorithm(llm, algorithm, workloads, params, args.batch_size)
        llm.close()
        del llm            # free this target and drafter before the next algorithm loads its own
        gc.collect()

    config = {k: v for k, v in vars(args).items() if k not in ("handler", "command", "speculative_algorithm")}
    record = build_record(cells, params.greedy, config, skipped)
    print(format_table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        plot(record, args.plot)
    return 0
