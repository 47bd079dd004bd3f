"""Drafters shipped inside the package, and the speculative configuration `serve` and `make demo` use
for the embedded target when no other is asked for."""
from __future__ import annotations

from pathlib import Path

# DSPARK drafter for the embedded SmolLM2-135M-Instruct target (trained with `specserve train-drafter`)
EMBEDDED_DSPARK = Path(__file__).resolve().parent / "smollm2-135m-dspark"


def embedded_pair() -> dict:
    """Engine arguments that add the shipped DSPARK drafter to the embedded target; empty if it is absent."""
    if not (EMBEDDED_DSPARK / "config.json").is_file():
        return {}
    return {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": str(EMBEDDED_DSPARK),
            "speculative_ngram_hybrid": True}
