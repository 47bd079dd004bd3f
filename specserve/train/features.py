"""What drafter training reads from the target, computed once: the residual streams after the drafter's
target layers and the target's k likeliest next tokens at every position of every example.

`TargetPass` runs the target as the engine serves it (its quantization and attention dtype) over a batch
of sequences. `FeatureCache` stores its output on local disk (float16 features: ~5.8 KB per token for SmolLM2 with
five target layers) per sequence, under a key of everything else that changes it, so that training never
runs the target: in the old trainer the target's forward and its vocabulary
projection were ~70% of a step."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.engine import attention_dtype
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import LoadedCheckpoint
from specserve.models.llama import LlamaModel
from specserve.quantization import INT8_SCHEME

log = logging.getLogger(__name__)

PAGE_SIZE = 64                     # of the target's scratch KV pool


@dataclass(frozen=True)
class TargetFeatures:
    """A batch of sequences as the target sees them, zero-padded to the longest."""
    aux: torch.Tensor         # [B, L, K * hidden] residual streams after the K target layers, concatenated
    top_ids: torch.Tensor     # [B, L, k] the target's k likeliest tokens after each position, likeliest first
    top_probs: torch.Tensor   # [B, L, k] their probabilities


class TargetPass:
    """The target over whole sequences, causal and unpadded, in the numerics the engine serves it with. On a GPU
    (`device`) the same model runs its ops' references and attends through padded SDPA calls, in float32 over the
    pool as the row kernel (CPU code) attends: the features differ from the CPU's by rounding, and the cache key says
    so. `tokens_per_pass`: a batch's target tokens, 4,096 on the CPU (its caches), 65,536 on a GPU."""

    def __init__(self, target: LoadedCheckpoint, layer_ids: tuple[int, ...], top_k: int, quantization: str,
                 dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.kv_geometry = KVGeometry.of(target.config, attention_dtype(kv_cache_dtype, quantization, dtype))
        self.row_kernel = self.device.type == "cpu"
        self.tokens_per_pass = 4096 if self.row_kernel else 65536
        if not self.row_kernel and self.kv_geometry.dtype == torch.int8:
            raise ValueError("--kv-cache-dtype int8 features need the CPU attention kernel: build them with "
                             "--device cpu, or pick float16")
        self.model = LlamaModel(target.config, target.weights, dtype, quantization=quantization, device=self.device)
        self.layer_ids = layer_ids
        self.top_k = top_k
        self.pool: KVPool | None = None

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]]) -> TargetFeatures:
        B, L = len(sequences), max(map(len, sequences))
        aux, top_ids, top_probs = (t.cpu() for t in self.unpadded(sequences))
        inside = torch.arange(L) < torch.tensor([len(s) for s in sequences])[:, None]     # [B, L]
        out = TargetFeatures(torch.zeros(B, L, aux.shape[-1], dtype=aux.dtype),
                             torch.zeros(B, L, self.top_k, dtype=torch.long), torch.zeros(B, L, self.top_k))
        out.aux[inside] = aux
        out.top_ids[inside] = top_ids
        out.top_probs[inside] = top_probs
        return out

    def unpadded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pass on its device, unpadded: aux [tokens, K * hidden], top ids and probabilities [tokens, k]."""
        B, L = len(sequences), max(map(len, sequences))
        per_seq = -(-L // PAGE_SIZE)
        if self.pool is None or self.pool.num_pages < B * per_seq:
            self.pool = None        # the old pool's memory is free before the new one takes its own
            self.pool = KVPool(self.kv_geometry, B * per_seq, PAGE_SIZE, self.device)
        spans = [SeqSpan(list(range(b * per_seq, (b + 1) * per_seq)), 0, len(s)) for b, s in enumerate(sequences)]
        meta = (AttentionMetadata.for_pool(spans, self.pool) if self.row_kernel
                else AttentionMetadata.build(spans, PAGE_SIZE, self.pool.null_slot).to(self.device))
        tokens = torch.tensor([t for s in sequences for t in s], device=self.device)
        positions = torch.tensor([p for s in sequences for p in range(len(s))], device=self.device)
        hidden, aux = self.model.forward(tokens, positions, meta, self.pool, self.layer_ids)
        top_ids, top_probs = [], []
        for rows in hidden.split(1024):
            probs = self.model.logits(rows).float().softmax(-1)                   # [n, vocab]
            top = probs.topk(self.top_k, dim=-1)
            top_ids.append(top.indices)
            top_probs.append(top.values)
        return torch.cat(aux, dim=-1), torch.cat(top_ids), torch.cat(top_probs)


def cache_files(width: int, top_k: int) -> dict[str, tuple[type, int]]:
    """The cache's files, one row per token in each: name → (dtype, values per row), in TargetFeatures' order."""
    return {"features.bin": (np.float16, width), "top_ids.bin": (np.int32, top_k), "top_probs.bin": (np.float16, top_k)}


def sequence_hash(tokens: list[int]) -> str:
    return hashlib.sha1(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:20]


class FeatureCache:
    """TargetPass outputs in three flat files of one row per token (features, top ids, top probabilities)
    under a folder named by the key (target file, numerics, layers, k), and index.jsonl, one line per
    stored sequence {"hash", "start", "length"} written once its rows are on disk. A build computes only
    the sequences the folder lacks, so an interrupted build resumes and a larger training set extends it.
    `read` addresses the sequences the cache was built or opened for, by their position in that list, and
    returns the features of `read_layers` (default: every stored layer): a cache built for more target layers
    serves a drafter that reads fewer of them (`covering`)."""

    def __init__(self, folder: Path, spans: list[tuple[int, int]], layer_ids: tuple[int, ...], hidden_size: int,
                 top_k: int, dtype: torch.dtype, read_layers: tuple[int, ...] | None = None) -> None:
        self.folder, self.spans, self.layer_ids, self.top_k, self.dtype = folder, spans, layer_ids, top_k, dtype
        self.hidden_size = hidden_size
        self.read_layers = layer_ids if read_layers is None else read_layers
        if not set(self.read_layers) <= set(layer_ids):
            raise ValueError(f"the feature cache {folder} holds target layers {list(layer_ids)}, "
                             f"not {list(self.read_layers)}")
        self.columns = None if self.read_layers == layer_ids else np.concatenate(
            [np.arange(hidden_size) + layer_ids.index(i) * hidden_size for i in self.read_layers])
        files = cache_files(len(layer_ids) * hidden_size, top_k)
        dtype, n = files["top_ids.bin"]
        rows = (folder / "top_ids.bin").stat().st_size // (np.dtype(dtype).itemsize * n)
        self.features, self.top_ids, self.top_probs = (np.memmap(folder / name, dtype, "r", shape=(rows, n))
                                                       for name, (dtype, n) in files.items())

    @staticmethod
    def key(target: LoadedCheckpoint, pass_: TargetPass, quantization: str) -> dict:
        """Everything a stored row depends on besides its tokens: the target file and its numerics (weights,
        compute and attention dtypes, the device off the CPU), the layers and k."""
        source = Path(target.source)
        key = {"target": source.name, "target_bytes": source.stat().st_size if source.is_file() else None,
               "quantization": quantization if quantization == "none" else f"{quantization}-{INT8_SCHEME}",
               "dtype": str(pass_.model.dtype),
               "attention": str(pass_.kv_geometry.dtype), "layer_ids": list(pass_.layer_ids), "top_k": pass_.top_k}
        return key if pass_.row_kernel else {**key, "device": pass_.device.type}

    @staticmethod
    def folder_for(root: Path, key: dict) -> Path:
        return root / hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def covering(cls, root: Path, key: dict, sequences: list[list[int]]) -> dict:
        """The key to build for `sequences`: `key`, unless a cache under root of more target layers, all else
        equal (EAGLE's 3 layers among a block drafter's 5), already holds more of them; then build that one and
        `select` key's layers."""
        needed = {sequence_hash(s) for s in sequences}

        def held(k: dict) -> int:
            return len(needed & cls.stored(cls.folder_for(root, k)).keys())

        best, most = key, held(key)
        for path in sorted(root.glob("*/key.json")):
            try:
                other = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            covers = ({**other, "layer_ids": None} == {**key, "layer_ids": None}
                      and set(key["layer_ids"]) < set(other["layer_ids"]))
            if covers and held(other) > most:
                best, most = other, held(other)
        return best

    def select(self, layer_ids: tuple[int, ...]) -> FeatureCache:
        """This cache, reading the features of `layer_ids` (some of its layers) only."""
        return FeatureCache(self.folder, self.spans, self.layer_ids, self.hidden_size, self.top_k, self.dtype,
                            layer_ids)

    @staticmethod
    def stored(folder: Path) -> dict[str, tuple[int, int]]:
        """hash → (first row, length) of each sequence index.jsonl records; a line cut off mid-write is dropped."""
        index = {}
        path = folder / "index.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                index[entry["hash"]] = (entry["start"], entry["length"])
        return index

    @classmethod
    def build(cls, root: Path, key: dict, sequences: list[list[int]], pass_: TargetPass,
              tokens_per_pass: int | None = None) -> FeatureCache:
        """The cache of `sequences` under root, the target run (over batches of about `tokens_per_pass` tokens,
        default the pass's own) for those it does not hold yet."""
        tokens_per_pass = tokens_per_pass or pass_.tokens_per_pass
        folder = cls.folder_for(root, key)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "key.json").write_text(json.dumps(key))
        width = len(pass_.layer_ids) * pass_.model.config.hidden_size
        files = cache_files(width, pass_.top_k)
        row_bytes = {name: np.dtype(dtype).itemsize * n for name, (dtype, n) in files.items()}
        index = cls.stored(folder)
        rows = max((start + length for start, length in index.values()), default=0)
        with open(folder / "index.jsonl", "w") as f:         # rewritten whole: drops a line cut off mid-write
            f.writelines(json.dumps({"hash": h, "start": a, "length": n}) + "\n" for h, (a, n) in index.items())
        for name, size in row_bytes.items():                  # and rows written after the last indexed sequence
            with open(folder / name, "ab") as f:
                f.truncate(rows * size)
        hashes = [sequence_hash(s) for s in sequences]
        todo = list({h: s for h, s in zip(hashes, sequences) if h not in index}.items())
        if index and todo:
            log.info("feature cache %s: %d sequences stored, computing %d more", folder, len(index), len(todo))
        handles = {name: open(folder / name, "ab") for name in row_bytes}
        try:
            with open(folder / "index.jsonl", "a") as index_file, \
                    tqdm(total=sum(len(s) for _, s in todo), desc="target features", unit="tok") as bar:
                done = 0
                while done < len(todo):
                    batch, count = [], 0
                    while done + len(batch) < len(todo) and (not batch or count + len(todo[done + len(batch)][1])
                                                             <= tokens_per_pass):
                        batch.append(todo[done + len(batch)])
                        count += len(batch[-1][1])
                    out = pass_([s for _, s in batch])
                    for b, (h, s) in enumerate(batch):
                        n = len(s)
                        for (name, (dtype, _)), rows_of in zip(files.items(), (out.aux, out.top_ids, out.top_probs)):
                            handles[name].write(rows_of[b, :n].numpy().astype(dtype).tobytes())
                        index[h] = (rows, n)
                        rows += n
                    for f in handles.values():
                        f.flush()
                    index_file.writelines(json.dumps({"hash": h, "start": index[h][0], "length": index[h][1]}) + "\n"
                                          for h, _ in batch)
                    index_file.flush()
                    done += len(batch)
                    bar.update(count)
        finally:
            for f in handles.values():
                f.close()
        return cls(folder, [index[h] for h in hashes], pass_.layer_ids, pass_.model.config.hidden_size, pass_.top_k,
                   pass_.model.dtype)

    def read(self, indices: list[int], dtype: torch.dtype | None = None) -> TargetFeatures:
        """The rows of sequences `indices`, zero-padded like TargetPass's output, their features in `dtype` (default
        the training dtype; float16, as stored, leaves the widening to a GPU and halves the copy to it)."""
        spans = [self.spans[i] for i in indices]
        B, L = len(indices), max(n for _, n in spans)
        out = TargetFeatures(torch.zeros(B, L, len(self.read_layers) * self.hidden_size, dtype=dtype or self.dtype),
                             torch.zeros(B, L, self.top_k, dtype=torch.long), torch.zeros(B, L, self.top_k))
        for b, (start, n) in enumerate(spans):
            rows = self.features[start:start + n]
            rows = rows if self.columns is None else rows[:, self.columns]
            out.aux[b, :n] = torch.from_numpy(np.array(rows))      # a copy: the memmap is read-only
            out.top_ids[b, :n] = torch.from_numpy(np.asarray(self.top_ids[start:start + n], dtype=np.int64))
            out.top_probs[b, :n] = torch.from_numpy(np.asarray(self.top_probs[start:start + n], dtype=np.float32))
        return out
