"""Converted GGUF checkpoints cached as Hugging Face folders, keyed by file content and dtype."""
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.loader import gguf as gguf_loader
from specserve.loader.checkpoint import LoadedCheckpoint, ModelLoadError
from specserve.loader.safetensors import hf_config, load_folder


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve" / "models")


def file_sha256(path: str | Path) -> str:
    """sha256 of the file, memoized by (path, size, mtime) so warm starts skip rehashing."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_file = cache_root() / "hashes.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    memo = {k: v for k, v in memo.items() if not k.startswith(f"{path}|")}  # forget older versions
    memo[key] = digest.hexdigest()
    _write_atomically(memo_file, json.dumps(memo, indent=1))
    return memo[key]


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def entry_dir(path: str | Path, dtype: torch.dtype) -> Path:
    return cache_root() / file_sha256(path)[:16] / str(dtype).removeprefix("torch.")


# What the GGUF said that a Hugging Face folder cannot: whether its weights were quantized.
SOURCE_FILE = "source.json"


def save_entry(ckpt: LoadedCheckpoint, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
    try:
        save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(hf_config(ckpt.config), indent=2))
        ckpt.tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"quantized": ckpt.quantized}))
        tmp.rename(entry)  # atomic; fails harmlessly if a concurrent load got there first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_cached(path: str, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    entry = entry_dir(path, dtype)
    if entry.is_dir():
        try:
            quantized = json.loads((entry / SOURCE_FILE).read_text())["quantized"]
            return replace(load_folder(entry, dtype), source=path, quantized=quantized)
        except (ModelLoadError, OSError, ValueError, KeyError):
            shutil.rmtree(entry, ignore_errors=True)  # a damaged or older entry is rebuilt from the GGUF below
    ckpt = gguf_loader.load_gguf(path, dtype)
    try:
        save_entry(ckpt, entry)
    except OSError as e:
        if not entry.is_dir():
            warnings.warn(f"could not cache {path} in {entry} ({e}); the next load converts it again",
                          stacklevel=2)
    return ckpt
