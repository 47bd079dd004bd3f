"""Head-of-line blocking: a short chat request arrives while a long prompt prefills. Measured side by side in
one run on the embedded target: the short request's time to first token, and the long prompt's time to its
first token alone and with the short one beside it, with the prefill-chunk cap (the default) and without
one (--max-prefill-chunk equal to the step budget, the old behaviour). Writes benchmarks/results/hol.json.

    .venv/bin/python benchmarks/hol.py [--long-tokens 6000]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402


def first_tokens(llm: LLM, long: list[int], short: list[int] | None) -> dict[str, float]:
    """Seconds from each request's arrival to its first token; the short one arrives after the first step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(long, params, request_id="long")
    engine.step()
    arrived = time.perf_counter()
    if short is not None:
        engine.add_request(short, params, request_id="short")
    seen: dict[str, float] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token_ids and out.request_id not in seen:
                seen[out.request_id] = time.perf_counter() - (start if out.request_id == "long" else arrived)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-tokens", type=int, default=6000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = {}
    for label, chunk in (("capped (default)", None), ("uncapped", 1024)):
        llm = LLM(disable_radix_cache=True, max_prefill_chunk=chunk)
        tokenizer = llm.tokenizer
        long = tokenizer.encode(" ".join(CHAT_PROMPTS) * 400, add_special_tokens=False)[:args.long_tokens]
        short = llm.engine.encode("Say hi.", chat=True)
        alone = first_tokens(llm, long, None)
        both = first_tokens(llm, long, short)
        rows[label] = {"short_ttft_s": round(both["short"], 2), "long_ttft_alone_s": round(alone["long"], 2),
                       "long_ttft_with_short_s": round(both["long"], 2),
                       "max_prefill_chunk": llm.engine.config.scheduler.max_prefill_chunk}
        print(label, rows[label], flush=True)
        del llm
    capped, old = rows["capped (default)"], rows["uncapped"]
    summary = {"short_ttft_s": capped["short_ttft_s"], "short_ttft_uncapped_s": old["short_ttft_s"],
               "long_prefill_capped_over_uncapped": round(capped["long_ttft_with_short_s"]
                                                          / old["long_ttft_with_short_s"], 3),
               "long_prefill_alone_capped_over_uncapped": round(capped["long_ttft_alone_s"]
                                                                / old["long_ttft_alone_s"], 3)}
    print(summary)
    path = write_result("hol", summary, {"config": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
