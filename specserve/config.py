"""Frozen configuration records, and the engine's command-line flags derived from their fields: each
flag's default is the field's default, so it is written once. Sizes measured at runtime (pages, cost
tables) are not stored here. Nothing here imports torch, so building a parser stays cheap."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field


def flag(*names: str, help: str) -> dict:
    """Field metadata: the command-line spellings of a field (the first is the main one) and its help."""
    return {"flags": names, "help": help}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = field(default=16, metadata=flag("--page-size", help="tokens per KV page"))
    memory_bytes: int = field(default=1 << 30, metadata=flag(
        "--kv-cache-memory", help="bytes for all KV pools together (target + draft, split by bytes per token)"))
    num_pages: int | None = None         # overrides memory_bytes when set (tests)
    disable_radix_cache: bool = field(default=False, metadata=flag(
        "--disable-radix-cache", help="turn off prefix reuse across requests"))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "--kv-cache-dtype", help="auto | float32 | float16 | int8 | float64: the target's KV cache (auto: float16 "
                                 "under int8 weights, else the compute dtype). float32, float16 and int8 attend in "
                                 "the row-invariant kernel (float16: half the bytes; int8: one scale per token and "
                                 "KV head: 68 bytes a head of 64 values vs float16's 128); float64: padded SDPA"))


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = field(default=64, metadata=flag(
        "--max-running-requests", help="requests decoded together"))
    max_num_batched_tokens: int = field(default=1024, metadata=flag(
        "--max-num-batched-tokens", help="token budget per step (chunked prefill)"))
    max_prefill_chunk: int | None = field(default=None, metadata=flag(
        "--max-prefill-chunk", help="prompt tokens one request may prefill in a step while other requests wait or "
                                    "decode (default: an eighth of --max-num-batched-tokens); alone it takes all"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "--max-model-len", help="context length cap (default: the model's)"))


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str = field(default="NONE", metadata=flag(
        "--speculative-algorithm", help="NONE | NGRAM | STANDALONE | EAGLE | DFLASH | DSPARK"))
    num_draft_tokens: int = field(default=0, metadata=flag(
        "--speculative-num-draft-tokens", help="drafts per step for NGRAM/STANDALONE/EAGLE (0: the default, 4/4/3)"))
    draft_model_path: str | None = field(default=None, metadata=flag(
        "--speculative-draft-model-path",
        help="draft model (STANDALONE) or drafter checkpoint folder (EAGLE/DFLASH/DSPARK)"))
    ngram_min: int = field(default=1, metadata=flag(
        "--speculative-ngram-min-match-window-size", "--speculative-ngram-min", help="shortest n-gram NGRAM looks up"))
    ngram_max: int = field(default=4, metadata=flag(
        "--speculative-ngram-max-match-window-size", "--speculative-ngram-max", help="longest n-gram NGRAM looks up"))
    block_size: int = field(default=8, metadata=flag(
        "--speculative-block-size", "--speculative-dspark-block-size",
        help="block drafter rows (gamma): drafts per step for DFLASH and DSPARK"))
    dspark_confidence_threshold: float | None = field(default=None, metadata=flag(
        "--speculative-dspark-confidence-threshold",
        help="cut DSPARK windows where survival < X (default: the budget planner)"))
    dspark_cost_table_path: str | None = field(default=None, metadata=flag(
        "--speculative-dspark-cost-table",
        help="cost table from `specserve profile` (default: the saved one for this model, else measured at start)"))
    dspark_block_cost: float | None = field(default=None, metadata=flag(
        "--speculative-dspark-block-cost",
        help="a block row's time over a target row's, for the planner (default: the ratio of the weights each "
             "multiplies through, plus the blocks' measured time beyond it)"))
    token_map_path: str | None = field(default=None, metadata=flag(
        "--speculative-token-map", help="draft vocabulary file (overrides the drafter's)"))
    sampling: str = field(default="coupled", metadata=flag(
        "--speculative-sampling",
        help="coupled | rejection: how sampled requests without a seed are verified. coupled gives each a seed, "
             "so its output is the one plain decoding with that seed gives; rejection sampling accepts more "
             "drafts when the drafter's distribution differs from the target's. Seeded requests are always "
             "coupled"))
    ngram_hybrid: bool = field(default=False, metadata=flag(
        "--speculative-ngram-hybrid",
        help="DSPARK: verify an n-gram continuation instead when it promises more tokens"))


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = field(default=1, metadata=flag(
        "--tp-size", "--tp", "--tensor-parallel-size",
        help="tensor-parallel ranks (processes, torch.distributed): attention heads, MLP columns, the vocabulary "
             "and the KV cache split over them; must divide the KV heads"))
    dp_size: int = field(default=1, metadata=flag(
        "--dp-size", "--dp", "--data-parallel-size",
        help="serve: independent engine replicas behind the one HTTP front, each request routed to the one with "
             "the fewest running and queued requests"))
    nnodes: int = field(default=1, metadata=flag("--nnodes", help="machines the tensor-parallel ranks span"))
    node_rank: int = field(default=0, metadata=flag(
        "--node-rank", help="this machine's index among --nnodes; 0 runs the engine, others run ranks only"))
    dist_init_addr: str | None = field(default=None, metadata=flag(
        "--dist-init-addr", help="HOST:PORT of node 0 where the ranks meet (default: a free local port, one node)"))


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = field(default=None, metadata=flag(
        "--model-path", help="GGUF file, HF folder or fetch-model name (default: embedded SmolLM2-135M-Instruct)"))
    dtype: str = field(default="float32", metadata=flag(
        "--dtype", help="compute dtype: float32 (fastest on CPUs without bf16 units) or float64"))
    quantization: str | None = field(default=None, metadata=flag(
        "--quantization", help="none | int8: int8 weights per output channel and int8 activations per token in "
                               "every linear (default: int8 when the checkpoint stores quantized weights, as a "
                               "Q4/Q8 GGUF does; none otherwise)"))
    seed: int = 0
    num_threads: int | None = field(default=None, metadata=flag("--threads", help="torch CPU threads"))
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# Engine keyword arguments are flat, as on the command line: a section's field keeps its name, SpecConfig's
# take the prefix `speculative_`.
SECTIONS = {"cache": (CacheConfig, ""), "scheduler": (SchedulerConfig, ""), "spec": (SpecConfig, "speculative_"),
            "parallel": (ParallelConfig, "")}


@dataclass(frozen=True)
class EngineFlag:
    flags: tuple[str, ...]
    dest: str                  # engine keyword argument
    type: type
    default: object
    help: str


def _flags_of(cls: type, prefix: str) -> list[EngineFlag]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "flags" not in f.metadata:
            continue
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):      # `X | None` → X
            hint = next(t for t in typing.get_args(hint) if t is not type(None))
        out.append(EngineFlag(f.metadata["flags"], prefix + f.name, hint, f.default, f.metadata["help"]))
    return out


ENGINE_FLAGS: tuple[EngineFlag, ...] = tuple(
    _flags_of(EngineConfig, "") + [fl for cls, prefix in SECTIONS.values() for fl in _flags_of(cls, prefix)])


def add_engine_args(parser: argparse.ArgumentParser, only: Iterable[str] | None = None) -> None:
    """Every engine flag, or those whose main spelling is in `only`."""
    wanted = None if only is None else set(only)
    for fl in ENGINE_FLAGS:
        if wanted is not None and fl.flags[0] not in wanted:
            continue
        if fl.type is bool:
            parser.add_argument(*fl.flags, dest=fl.dest, action="store_true", help=fl.help)
        else:
            parser.add_argument(*fl.flags, dest=fl.dest, type=fl.type, default=fl.default, help=fl.help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags a parser built with `add_engine_args` filled in, as engine keyword arguments."""
    return {fl.dest: getattr(args, fl.dest) for fl in ENGINE_FLAGS if hasattr(args, fl.dest)}


def _section_field(key: str) -> tuple[str, str] | None:
    """The section and field a flat engine argument names, if a section owns it."""
    for section, (cls, prefix) in SECTIONS.items():
        name = key.removeprefix(prefix)
        if key.startswith(prefix) and name in {f.name for f in dataclasses.fields(cls)}:
            return section, name
    return None


def engine_config(model_path: str | None = None, **kwargs) -> EngineConfig:
    """Flat keyword arguments (as on the command line) → nested EngineConfig."""
    sections: dict[str, dict] = {section: {} for section in SECTIONS}
    top = {"model_path": model_path}
    top_fields = {f.name for f in dataclasses.fields(EngineConfig)} - SECTIONS.keys()
    for key, value in kwargs.items():
        if (owner := _section_field(key)) is not None:
            sections[owner[0]][owner[1]] = value
        elif key in top_fields:
            top[key] = value
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(**top, **{section: SECTIONS[section][0](**values) for section, values in sections.items()})
