"""Frozen configuration records. Sizes measured at runtime (pages, cost tables) are not stored here."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    page_size: int = 16
    memory_bytes: int = 1 << 30          # budget for all KV pools together
    num_pages: int | None = None         # overrides memory_bytes when set (tests)
    disable_radix_cache: bool = False    # True: no prefix reuse across requests


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_num_batched_tokens: int = 1024   # chunked-prefill token budget per step
    max_model_len: int | None = None     # defaults to the model's context length


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str = "NONE"
    num_draft_tokens: int = 0
    draft_model_path: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    dspark_block_size: int = 8                          # gamma: block rows = drafts (DFLASH, DSPARK)
    dspark_confidence_threshold: float | None = None    # None: the budget planner sizes DSPARK windows
    dspark_cost_table_path: str | None = None           # None: measure a small cost table at startup
    dspark_block_cost: float | None = None              # a block row's time / a target row's; None: from weights
    token_map_path: str | None = None                   # draft vocabulary, overrides the checkpoint's
    ngram_hybrid: bool = False                          # DSPARK also weighs an n-gram continuation per step


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None        # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "float32"
    seed: int = 0
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
