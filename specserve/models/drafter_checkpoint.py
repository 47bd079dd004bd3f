"""What drafter checkpoints (block drafters, EAGLE heads) share: the folder (config.json +
model.safetensors in Hugging Face layout), reading a config dataclass from JSON, the default target
layers, and the startup checks that a drafter fits its target."""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.config import ModelConfig
from specserve.loader import ModelLoadError

log = logging.getLogger(__name__)
C = TypeVar("C")


def save_drafter_folder(folder: str | Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))


def read_drafter_folder(folder: str | Path, kind: str,
                        parse: Callable[[dict, str], C]) -> tuple[C, dict[str, torch.Tensor]]:
    """A drafter folder's config (parsed, and so checked, before the weights are read) and weights;
    `kind` names what was expected in errors."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ModelLoadError(f"{folder} is not {kind}: --speculative-draft-model-path "
                             "needs a folder with config.json and model.safetensors")
    try:
        config = parse(json.loads((folder / "config.json").read_text()), str(folder))
        return config, load_file(str(folder / "model.safetensors"))
    except (json.JSONDecodeError, SafetensorError) as e:
        raise ModelLoadError(f"{folder} is corrupt ({e})") from e


def config_from_json(cls: type[C], data: dict, source: str) -> C:
    """The dataclass `cls` from a config.json's fields (extra keys ignored); JSON lists become the tuples
    of tuple fields."""
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
    if missing:
        raise ModelLoadError(f"{source}/config.json lacks {', '.join(missing)}")
    values = {f.name: data[f.name] for f in fields if f.name in data}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def default_layer_ids(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers spread evenly from the first to the last."""
    count = min(count, num_target_layers)
    return tuple(sorted({round(i * (num_target_layers - 1) / max(count - 1, 1)) for i in range(count)}))


def mismatch(source: str, target: ModelConfig) -> Callable[[str], ModelLoadError]:
    """The error a drafter that cannot draft for `target` raises, with the reason."""
    return lambda why: ModelLoadError(f"{source} cannot draft for {target.name or target.architecture}: {why}")


def check_fits_target(source: str, target: ModelConfig, *, target_name: str, hidden_size: int,
                      target_vocab_size: int, target_layer_ids: tuple[int, ...],
                      weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ModelLoadError at startup for what every drafter must share with its target: hidden size,
    vocabulary, the layers it reads, and tensors of the shapes its config implies."""
    bad = mismatch(source, target)
    if target_name and target.name and target_name != target.name:
        log.warning("%s was trained for %s, not %s", source, target_name, target.name)
    if hidden_size != target.hidden_size:
        raise bad(f"it was built for hidden size {hidden_size} but the target's is {target.hidden_size}")
    if target_vocab_size != target.vocab_size:
        raise bad(f"it was built for a vocabulary of {target_vocab_size} but the target has {target.vocab_size}")
    ids = target_layer_ids
    if not ids or any(not 0 <= i < target.num_layers for i in ids) or list(ids) != sorted(set(ids)):
        raise bad(f"target_layer_ids {list(ids)} must be increasing layer ids in [0, {target.num_layers})")
    for name, shape in shapes.items():
        if name not in weights:
            raise bad(f"tensor {name} is missing")
        if tuple(weights[name].shape) != shape:
            raise bad(f"tensor {name} has shape {list(weights[name].shape)}, expected {list(shape)}")
