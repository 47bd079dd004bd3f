"""Drafters shipped inside the package, and the speculative configuration `serve` and `make demo` use
for the embedded target when no other is asked for."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from specserve.config import SpecConfig

# DSPARK drafter for the embedded SmolLM2-135M-Instruct target (trained with `specserve train-drafter`)
EMBEDDED_DSPARK = Path(__file__).resolve().parent / "smollm2-135m-dspark"


def embedded_pair() -> dict:
    """Engine arguments that add the shipped DSPARK drafter to the embedded target; empty if it is absent."""
    if not (EMBEDDED_DSPARK / "config.json").is_file():
        return {}
    return {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": str(EMBEDDED_DSPARK),
            "speculative_ngram_hybrid": True}


def with_shipped_drafter_path(spec: SpecConfig) -> SpecConfig:
    """DSPARK on the embedded target without a drafter path: the shipped drafter."""
    if spec.algorithm.upper() == "DSPARK" and not spec.draft_model_path and (EMBEDDED_DSPARK / "config.json").is_file():
        return dataclasses.replace(spec, draft_model_path=str(EMBEDDED_DSPARK))
    return spec


def with_shipped_drafter(kwargs: dict) -> dict:
    """`serve` defaults to the embedded pair: on the embedded target, no speculative algorithm (None) means
    DSPARK with the shipped drafter (n-gram hybrid on), and DSPARK without a drafter path means that
    drafter. Any other target runs what its arguments say (plain decoding by default)."""
    algorithm = kwargs["speculative_algorithm"]
    pair = embedded_pair() if kwargs["model_path"] is None else {}
    if algorithm is None:
        return {**kwargs, **pair} if pair else {**kwargs, "speculative_algorithm": "NONE"}
    if algorithm.upper() == "DSPARK" and not kwargs["speculative_draft_model_path"] and pair:
        return {**kwargs, "speculative_draft_model_path": pair["speculative_draft_model_path"]}
    return kwargs
