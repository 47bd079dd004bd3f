"""Model registry: architecture name → implementation."""
from specserve.models.llama import LlamaModel

ARCHITECTURES = {"llama": LlamaModel, "qwen2": LlamaModel, "qwen3": LlamaModel}

__all__ = ["ARCHITECTURES", "LlamaModel"]
