"""specserve: LLM inference with first-class speculative decoding."""
from specserve.types import RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from specserve.engine import LLM
        return LLM
    raise AttributeError(name)
