"""Drafter training throughput, side by side in one run, same drafter (DSPARK, the embedded SmolLM2 target,
the committed training data), in rows per second (valid block rows, one loss term each):

  live, 64 anchors     the target runs inside every step, 64 random anchors per sequence (the recipe before
                       the feature cache)
  cached, 64 anchors   the target's features and top-k come from the feature cache
  cached, every anchor a block at every answer position (the trainer's default)
  ..., bfloat16        the same under `--dtype bfloat16` (autocast over float32 weights: fast on CPUs with
                       bf16 units, e.g. AVX-512 BF16; the machine's `bf16_units` say which it has)

plus the feature cache's build rate (target tokens per second, paid once per training set). Writes
benchmarks/results/train_throughput.json.

    .venv/bin/python benchmarks/train_throughput.py [--steps 6] [--examples 40]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from specserve.loader import load_checkpoint  # noqa: E402
from specserve.quantization import served_quantization  # noqa: E402
from specserve.train.data import build_token_map, load_examples  # noqa: E402
from specserve.train.features import FeatureCache, TargetPass  # noqa: E402
from specserve.train.trainer import (  # noqa: E402
    DrafterTrainer,
    TrainConfig,
    batch_indices,
    make_batch,
    sequence,
    usable_examples,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "smollm2-135m-sharegpt-regenerated.jsonl.gz"


def rows_per_second(trainer: DrafterTrainer, examples, features, steps: int) -> float:
    rows, elapsed = 0, 0.0
    for step in tqdm(range(steps + 1), desc="steps", leave=False):
        start = time.perf_counter()
        indices = batch_indices(len(examples), trainer.cfg.batch_size, step, trainer.cfg.seed)
        terms, _ = trainer.train_step(make_batch([examples[i] for i in indices], features(indices)))
        if step:                                          # the first step warms up
            rows += terms.rows
            elapsed += time.perf_counter() - start
    return rows / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--examples", type=int, default=40, help="training examples cached for the run")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_checkpoint(None)
    examples = usable_examples(load_examples(DATA), 1024)[:args.examples]
    token_map = build_token_map(examples, 8192, target.config.vocab_size)
    base = TrainConfig(block_size=8, markov_rank=64, batch_size=4)
    quantization = served_quantization(None, target)
    layer_ids = DrafterTrainer(target, base, token_map).config.target_layer_ids
    target_pass = TargetPass(target, layer_ids, base.target_top_k, quantization)
    sequences = [sequence(e) for e in examples]
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        cache = FeatureCache.build(Path(root), FeatureCache.key(target, target_pass, quantization),
                                   sequences, target_pass)
        build_rate = sum(map(len, sequences)) / (time.perf_counter() - start)

        def live(indices: list[int]):
            return target_pass([sequences[i] for i in indices])

        runs = {"live_64_anchors": (64, live, "float32"), "cached_64_anchors": (64, cache.read, "float32"),
                "cached_every_anchor": (0, cache.read, "float32"),
                "cached_every_anchor_bfloat16": (0, cache.read, "bfloat16")}
        rates = {}
        for name, (anchors, features, dtype) in tqdm(runs.items(), desc="configurations"):
            trainer = DrafterTrainer(target, TrainConfig(**{**base.__dict__, "anchors": anchors, "dtype": dtype}),
                                     token_map)
            rates[name] = round(rows_per_second(trainer, examples, features, args.steps), 1)
    summary = {**{f"rows_per_s_{k}": v for k, v in rates.items()},
               "cached_every_anchor_over_live_64": round(rates["cached_every_anchor"] / rates["live_64_anchors"], 2),
               "bfloat16_over_float32_every_anchor": round(rates["cached_every_anchor_bfloat16"]
                                                           / rates["cached_every_anchor"], 2),
               "feature_cache_build_tok_per_s": round(build_rate, 1)}
    path = write_result("train_throughput", summary, {"config": {
        "drafter": "DSPARK, 1 layer, block 8, Markov rank 64, draft vocabulary 8192, context norm, anchor feature",
        "batch": "4 sequences", "steps": args.steps, "examples": args.examples, "quantization": quantization,
        "target_top_k": base.target_top_k}})
    for k, v in summary.items():
        print(f"{k:40s} {v}")
    print(path)


if __name__ == "__main__":
    main()
