"""Structured output under speculation on the embedded SmolLM2-135M (int8): 20 chat prompts that ask for a
person as JSON, each algorithm greedy with and without a JSON schema (response_format json_schema), measured
side by side in one run: acceptance length (tokens per target forward) and tokens per second, and whether every
finished output under the schema parses and validates. Writes benchmarks/results/structured.json.

    .venv/bin/python benchmarks/structured.py [--max-new-tokens 48] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from benchmarks.common import write_result  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.types import Grammar, SamplingParams, SpecStats  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"]}
SUBJECTS = ["a baker", "a pilot", "a student", "a painter", "a doctor", "a farmer", "a chef", "a poet", "a nurse",
            "a sailor", "a teacher", "a judge", "a miner", "a singer", "a diver", "a writer", "a tailor", "a monk",
            "a coach", "a pianist"]
PROMPTS = [f"Describe {s} as JSON with a name, an age and a city." for s in SUBJECTS]
DRAFTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters")
ALGORITHMS = {   # engine arguments: plain, then each algorithm with the drafter the other benchmarks use
    "plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM"}, "DSPARK": embedded_pair(),
    "DFLASH": {"speculative_algorithm": "DFLASH",
               "speculative_draft_model_path": os.path.join(DRAFTERS, "smollm2-135m-dflash")},
    "EAGLE": {"speculative_algorithm": "EAGLE",
              "speculative_draft_model_path": os.path.join(DRAFTERS, "smollm2-135m-eagle")},
}


def valid(text: str) -> bool:
    """A finished output under SCHEMA: JSON with exactly name, age (an integer) and city."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["age"], int)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    rows, plain_tokens = {}, None
    for name, kwargs in tqdm(ALGORITHMS.items(), desc="algorithms"):
        llm = LLM(num_threads=args.threads, **kwargs)
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=8), chat=True)   # warm up
        row = {}
        for mode, g in (("free", None), ("json_schema", grammar)):
            params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, grammar=g)
            llm.engine.stats = SpecStats()
            start, tokens, outs = time.perf_counter(), 0, []
            for prompt in PROMPTS:              # batch 1: the latency case speculation is for
                out = llm.generate(prompt, params, chat=True)[0]
                tokens += len(out.token_ids)
                outs.append(out)
            elapsed = time.perf_counter() - start
            stats = llm.engine.stats
            row[mode] = {"accept_length": round(stats.accept_length, 3), "tokens_per_s": round(tokens / elapsed, 2),
                         "tokens": tokens}
            if g is not None:
                finished = [o for o in outs if o.finish_reason == "stop"]
                row[mode]["finished"] = len(finished)
                row[mode]["all_finished_valid"] = all(valid(o.text) for o in finished)
                ids = [o.token_ids for o in outs]
                plain_tokens = plain_tokens or ids
                row[mode]["same_tokens_as_plain"] = ids == plain_tokens
        rows[name] = row
        print(name, json.dumps(row))
    summary = {f"{name}_accept_{mode}": rows[name][mode]["accept_length"] for name in rows for mode in rows[name]}
    summary["all_valid"] = all(r["json_schema"]["all_finished_valid"] for r in rows.values())
    summary["all_same_as_plain"] = all(r["json_schema"]["same_tokens_as_plain"] for r in rows.values())
    path = write_result("structured", summary, {"config": vars(args) | {"prompts": len(PROMPTS), "batch": 1},
                                                "schema": SCHEMA, "rows": rows})
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
