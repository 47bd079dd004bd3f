"""The n-gram hybrid's priors (NgramHybrid.PRIORS): how often each row of a prompt-lookup continuation holds, per
match length, on the target's own greedy answers. Writes benchmarks/results/ngram_priors.json and prints the table
in PRIORS' form, next to the committed one.

    .venv/bin/python benchmarks/ngram_priors.py [--data data/smollm2-135m-sharegpt-regenerated.jsonl.gz]
        [--examples 1000] [--stride 2]
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from specserve.speculative.ngram import NgramHybrid, continuation_rates  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def answers(path: Path, n: int):
    with gzip.open(path, "rt") as f:
        for line in tqdm(itertools.islice(f, n), total=n, desc="answers", unit="answer"):
            record = json.loads(line)
            yield record["prompt_ids"], record["output_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "data/smollm2-135m-sharegpt-regenerated.jsonl.gz"))
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--stride", type=int, default=2)
    args = parser.parse_args()
    rows = len(NgramHybrid.PRIORS[1])
    rates = continuation_rates(answers(Path(args.data), args.examples), 1, max(NgramHybrid.PRIORS), rows,
                               args.stride)
    table = {n: tuple(round(r, 2) for r in row if r is not None) for n, row in rates.items()}
    for n, row in table.items():
        print(f"{n}: {row},   committed {NgramHybrid.PRIORS.get(n)}")
    same = all(table.get(n) == tuple(row) for n, row in NgramHybrid.PRIORS.items())
    print("the committed PRIORS are these" if same else "the committed PRIORS differ")
    write_result("ngram_priors", {"matches_committed_priors": same},
                 {"priors": {str(n): row for n, row in table.items()}, "config": vars(args)})


if __name__ == "__main__":
    main()
