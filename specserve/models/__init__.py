"""Model registry: architecture name → implementation, and the compute dtypes models run in."""
import torch

from specserve.models.llama import LlamaModel

ARCHITECTURES = {"llama": LlamaModel, "qwen2": LlamaModel, "qwen3": LlamaModel}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

__all__ = ["ARCHITECTURES", "DTYPES", "LlamaModel"]
