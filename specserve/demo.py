"""`make demo`: load the embedded SmolLM2-135M-Instruct and answer a chat prompt, printing the text and speed."""
from __future__ import annotations

import logging
import sys
import time

from specserve.engine import LLM
from specserve.types import SamplingParams

PROMPT = "Explain in a few sentences why the sky is blue."


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    start = time.perf_counter()
    llm = LLM()
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_new_tokens=128)
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4), chat=True)   # warm-up
    start = time.perf_counter()
    out = llm.generate(PROMPT, params, chat=True)[0]
    elapsed = time.perf_counter() - start
    print(f"model: {llm.engine.model_config.name} (loaded in {load_s:.1f} s)")
    print(f"prompt: {PROMPT}\n")
    print(out.text.strip() + "\n")
    print(f"plain decoding: {len(out.token_ids)} tokens in {elapsed:.2f} s = {len(out.token_ids) / elapsed:.1f} tokens/s "
          f"(finish: {out.finish_reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
