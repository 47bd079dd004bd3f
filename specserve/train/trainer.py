"""The drafter trainer: batches of regenerated examples, random block anchors, the frozen target, the
drafter's tensors and optimizer (AdamW, warmup + cosine, gradient clipping), checkpoints that resume bit
for bit, and the calibration of DSPARK's confidence temperatures.

A step runs the target once over a batch of whole sequences without gradients (its hidden states and
distributions are constants), draws random anchors per sequence, and runs every anchor's block through
the drafter densely (models/block_drafter.py `dense_block_forward`), the same computation as the
engine's paged proposer: the block at anchor a sees the context of positions < a and its own rows.
EAGLE trains the same way with block_size chain rows per anchor instead of a block (models/eagle.py
`dense_chain_forward`: each row feeds the next its own output feature, as when drafting), over the
target's full vocabulary; it has no token map, Markov or confidence head."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import LoadedCheckpoint
from specserve.models import DTYPES
from specserve.models.block_drafter import (
    BlockDrafterCheckpoint,
    BlockDrafterConfig,
    dense_block_forward,
    random_block_drafter,
)
from specserve.models.eagle import EagleCheckpoint, EagleConfig, dense_chain_forward, random_eagle
from specserve.models.layers import Rope
from specserve.models.llama import LlamaModel
from specserve.train.data import Example
from specserve.train.losses import LossTerms, LossWeights, acceptance, block_loss, fit_temperatures, valid_rows

PAGE_SIZE = 64                     # of the target's scratch KV pool


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = "DSPARK"
    num_layers: int = 1
    block_size: int = 16               # block rows; EAGLE: chain rows (drafts per step)
    markov_rank: int = 64
    draft_vocab: int = 8192
    target_layer_ids: tuple[int, ...] | None = None     # None: 5 spread evenly (EAGLE: 3)
    max_steps: int = 2000
    time_budget: float | None = None    # seconds of training, across resumes; the LR follows whichever ends first
    batch_size: int = 4                 # sequences per step
    anchors: int = 64                   # blocks per sequence
    max_len: int = 1024                 # tokens per sequence (prompt + answer); longer ones are cut
    holdout: int = 64                   # examples kept back for calibration
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    dtype: str = "float32"              # bfloat16: float32 target and master weights, the drafter under autocast
    save_every: int = 200
    seed: int = 0
    loss: LossWeights = LossWeights()


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor               # [B, L] prompt + answer, zero-padded
    lengths: torch.Tensor              # [B]
    prompt_lens: torch.Tensor          # [B]


@dataclass(frozen=True)
class BlockOutputs:
    draft_logits: torch.Tensor               # [N, G, V_d] with the Markov term of the true previous token
    target_probs: torch.Tensor               # [N, G, V_d] the target's distribution of the row's token
    target_ids: torch.Tensor                 # [N, G] draft id of the true token, -1 outside the map
    valid: torch.Tensor                      # [N, G]
    confidence_logits: torch.Tensor | None   # [N, G] before the temperature (DSPARK)


def make_batch(examples: list[Example]) -> Batch:
    seqs = [e.prompt_ids + e.output_ids for e in examples]
    tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, seq in enumerate(seqs):
        tokens[b, :len(seq)] = torch.tensor(seq)
    return Batch(tokens, torch.tensor([len(s) for s in seqs]), torch.tensor([len(e.prompt_ids) for e in examples]))


def usable_examples(examples: list[Example], max_len: int) -> list[Example]:
    """Examples cut to `max_len` tokens that keep at least one anchor (two answer tokens), in a fixed
    order (by id hash) that does not depend on the order regeneration finished them in."""
    cut = [Example(e.id, e.prompt_ids, e.output_ids[:max_len - len(e.prompt_ids)]) for e in examples
           if len(e.prompt_ids) + 2 <= max_len]
    return sorted((e for e in cut if len(e.output_ids) >= 2), key=lambda e: (zlib.crc32(e.id.encode()), e.id))


def seeded(*keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(keys).encode()))


@functools.lru_cache(maxsize=4)
def epoch_order(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(num_examples, generator=seeded(seed, 1, epoch))


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of a step: consecutive slices of one seeded permutation per epoch, so any step's batch
    is known without replaying the steps before it (resume)."""
    return [int(epoch_order(num_examples, seed, k // num_examples)[k % num_examples])
            for k in range(step * batch_size, (step + 1) * batch_size)]


def sample_anchors(batch: Batch, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct random anchors per sequence → positions [B, count] and validity [B, count].
    Anchors are answer tokens with a next token: the engine's first block follows the first generated
    token, whose context is the whole prompt."""
    anchors = torch.zeros(len(batch.lengths), count, dtype=torch.long)
    valid = torch.zeros(len(batch.lengths), count, dtype=torch.bool)
    for b, (start, length) in enumerate(zip(batch.prompt_lens.tolist(), batch.lengths.tolist())):
        start = max(start, 1)
        picks = start + torch.randperm(max(length - 1 - start, 0), generator=generator)[:count].sort().values
        anchors[b, :len(picks)] = picks
        valid[b, :len(picks)] = True
    return anchors, valid


class DrafterTrainer:
    """A drafter's trainable tensors (Hugging Face layout), its optimizer and the frozen target."""

    def __init__(self, target: LoadedCheckpoint, cfg: TrainConfig, token_map: torch.Tensor | None) -> None:
        self.cfg = cfg
        dtype = DTYPES[cfg.dtype]
        self.autocast = dtype is torch.bfloat16
        self.dtype = torch.float32 if self.autocast else dtype
        tc = target.config
        self.target = LlamaModel(tc, target.weights, self.dtype)
        if cfg.algorithm == "EAGLE":
            if token_map is not None or cfg.num_layers != 1:
                raise ValueError("an EAGLE head has one layer and drafts over the target's whole vocabulary "
                                 "(no token map)")
            init = random_eagle(tc, target_layer_ids=cfg.target_layer_ids, seed=cfg.seed, dtype=self.dtype)
        else:
            init = random_block_drafter(tc, cfg.algorithm, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                        target_layer_ids=cfg.target_layer_ids, markov_rank=cfg.markov_rank,
                                        token_map=token_map, seed=cfg.seed, dtype=self.dtype)
        self.config: BlockDrafterConfig | EagleConfig = init.config
        if cfg.max_len + cfg.block_size > tc.max_position_embeddings:
            raise ValueError(f"--max-len {cfg.max_len} plus the block size exceeds the target's "
                             f"{tc.max_position_embeddings} positions")
        self.token_map = token_map
        self.params = {k: torch.nn.Parameter(v) for k, v in init.weights.items() if k != "token_map"}
        self.draft_ids = torch.arange(tc.vocab_size) if token_map is None else token_map.long()
        self.to_draft = torch.full((tc.vocab_size,), -1, dtype=torch.long)     # target id → draft id
        self.to_draft[self.draft_ids] = torch.arange(len(self.draft_ids))
        # tokens outside the map take the Markov head's extra all-zero row, as in the engine
        self.markov_index = torch.where(self.to_draft >= 0, self.to_draft, len(self.draft_ids))
        self.head = self.target.head.plain[:, self.draft_ids].contiguous()      # [hidden, V_d], frozen
        self.rope = Rope(self.config.head_dim, self.config.rope_theta, tc.max_position_embeddings, self.dtype)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        self.step = 0
        self.elapsed = 0.0
        self.pool: KVPool | None = None

    # ---- forward ---------------------------------------------------------------------------------
    @torch.no_grad()
    def target_pass(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over each whole sequence (causal, unpadded) → final-normed hidden [B, L, hidden]
        and the residual streams after target_layer_ids, concatenated: [B, L, K * hidden]."""
        B, L = batch.tokens.shape
        per_seq = -(-L // PAGE_SIZE)
        if self.pool is None or self.pool.num_pages < B * per_seq:
            self.pool = KVPool(KVGeometry.of(self.target.config, self.dtype), B * per_seq, PAGE_SIZE)
        lengths = batch.lengths.tolist()
        spans = [SeqSpan(list(range(b * per_seq, (b + 1) * per_seq)), 0, n) for b, n in enumerate(lengths)]
        meta = AttentionMetadata.build(spans, PAGE_SIZE, self.pool.null_slot)
        inside = torch.arange(L) < batch.lengths[:, None]                     # [B, L]
        hidden, aux = self.target.forward(batch.tokens[inside], torch.arange(L).expand(B, L)[inside], meta,
                                          self.pool, self.config.target_layer_ids)
        full_hidden = hidden.new_zeros(B, L, hidden.shape[-1])
        full_hidden[inside] = hidden
        full_aux = hidden.new_zeros(B, L, len(aux) * aux[0].shape[-1])
        full_aux[inside] = torch.cat(aux, dim=-1)
        return full_hidden, full_aux

    @torch.no_grad()
    def target_probs(self, hidden: torch.Tensor, positions: torch.Tensor,   # [B, L, hidden], [B, A, G]
                     valid: torch.Tensor) -> torch.Tensor:                   # [B, A, G] → [B, A, G, V_d]
        """The target's distribution at each valid row's position, on the draft vocabulary; each
        position's LM head runs once however many blocks cover it."""
        B, L, _ = hidden.shape
        seq = torch.arange(B)[:, None, None].expand_as(positions)[valid]
        pos = positions[valid]
        needed = torch.zeros(B, L, dtype=torch.bool)
        needed[seq, pos] = True
        index = needed.flatten().cumsum(0).view(B, L) - 1
        chunks = []
        for rows in hidden[needed].split(1024):
            logits = self.target.logits(rows)                                  # [n, vocab]
            chunks.append((logits[:, self.draft_ids] - logits.logsumexp(-1, keepdim=True)).exp())
        probs = hidden.new_zeros(*positions.shape, len(self.draft_ids))
        probs[valid] = torch.cat(chunks)[index[seq, pos]]
        return probs

    def heads(self, hidden: torch.Tensor,              # [..., hidden] block rows
              prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:   # [...] previous token ids
        """Draft logits over the draft vocabulary [..., V_d] (plus DSPARK's Markov term) and DSPARK's
        confidence logits [...] before the temperature."""
        logits = hidden @ self.head
        if self.config.algorithm != "DSPARK":
            return logits, None
        p = self.params
        w1 = p["markov.w1.weight"]
        markov = torch.cat([w1, w1.new_zeros(1, w1.shape[1])])[self.markov_index[prev]]     # [..., r]
        logits = logits + markov @ p["markov.w2.weight"].T
        # The confidence head reads detached features: its BCE estimates acceptance and must not
        # pull the drafter's states away from drafting.
        features = torch.cat([hidden, markov], dim=-1).detach()
        confidence = (features @ p["confidence.weight"].T).squeeze(-1) + p["confidence.bias"]
        return logits, confidence

    def forward(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor) -> BlockOutputs:
        """Every anchor's block ([B, A] positions) with its targets, flattened to N = B * A blocks."""
        G = self.cfg.block_size
        hidden, aux = self.target_pass(batch)
        positions = anchors[..., None] + torch.arange(G)                       # [B, A, G] row positions
        valid = valid_rows(anchors, anchor_valid, batch.lengths, G)
        last = batch.tokens.shape[1] - 1

        def tokens_at(pos: torch.Tensor) -> torch.Tensor:
            return batch.tokens.gather(1, pos.clamp(max=last).flatten(1)).view_as(pos)

        prev, following = tokens_at(positions), tokens_at(positions + 1)      # row k: tokens at a+k, a+k+1
        target_probs = self.target_probs(hidden, positions, valid)
        with torch.autocast("cpu", torch.bfloat16, enabled=self.autocast):
            if self.config.algorithm == "EAGLE":
                rows = dense_chain_forward(self.config, self.params, self.target.embed, self.rope, aux, batch.tokens,
                                           anchors, G)
            else:
                rows = dense_block_forward(self.config, self.params, self.target.embed, self.rope, aux, anchors,
                                           prev[..., 0])
            logits, confidence = self.heads(rows, prev)
        return BlockOutputs(logits.flatten(0, 1), target_probs.flatten(0, 1), self.to_draft[following].flatten(0, 1),
                            valid.flatten(0, 1), None if confidence is None else confidence.flatten(0, 1))

    def losses(self, batch: Batch, generator: torch.Generator) -> LossTerms:
        out = self.forward(batch, *sample_anchors(batch, self.cfg.anchors, generator))
        return block_loss(out.draft_logits, out.target_probs, out.target_ids, out.valid, out.confidence_logits,
                          self.cfg.loss)

    # ---- training --------------------------------------------------------------------------------
    def lr_factor(self) -> float:
        cfg = self.cfg
        warmup = max(1, round(cfg.warmup_ratio * cfg.max_steps))
        if self.step < warmup:
            return (self.step + 1) / warmup
        progress = (self.step - warmup) / max(cfg.max_steps - warmup, 1)
        if cfg.time_budget:
            progress = max(progress, self.elapsed / cfg.time_budget)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def train_step(self, batch: Batch) -> tuple[LossTerms, float]:
        lr = self.cfg.lr * self.lr_factor()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        terms = self.losses(batch, seeded(self.cfg.seed, 2, self.step))
        self.optimizer.zero_grad(set_to_none=True)
        terms.total.backward()
        torch.nn.utils.clip_grad_norm_(self.params.values(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return terms, lr

    def out_of_time(self) -> bool:
        return self.cfg.time_budget is not None and self.elapsed >= self.cfg.time_budget

    def train(self, examples: list[Example], state_path: Path, until: int | None = None,
              log_path: Path | None = None) -> None:
        """Train up to step `until` (default max_steps) or the time budget, saving the state every
        save_every steps and at the end."""
        cfg = self.cfg
        until = min(until or cfg.max_steps, cfg.max_steps)
        start, elapsed_before = time.perf_counter(), self.elapsed
        running: dict[str, float] = {}
        with tqdm(initial=self.step, total=until, desc=f"train {self.config.algorithm}", unit="step") as bar:
            while self.step < until and not self.out_of_time():
                batch = make_batch([examples[i] for i in batch_indices(len(examples), cfg.batch_size, self.step,
                                                                       cfg.seed)])
                terms, lr = self.train_step(batch)
                self.elapsed = elapsed_before + time.perf_counter() - start
                now = {"loss": terms.total.item(), "acc": terms.acceptance, "tau": terms.accept_length}
                running = {k: v if k not in running else 0.9 * running[k] + 0.1 * v for k, v in now.items()}
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in running.items()})
                if log_path is not None:
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": self.step, "lr": lr, "elapsed": round(self.elapsed, 2),
                                            "tokens": int(batch.lengths.sum()),
                                            **{k: getattr(terms, k) for k in ("ce", "dist", "confidence",
                                                                              "acceptance", "accept_length")},
                                            "loss": terms.total.item()}) + "\n")
                if self.step % cfg.save_every == 0:
                    self.save(state_path)
        self.save(state_path)

    # ---- state -----------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        state = {"step": self.step, "elapsed": self.elapsed, "drafter": self.config.to_json(),
                 "token_map": self.token_map, "weights": {k: p.detach() for k, p in self.params.items()},
                 "optimizer": self.optimizer.state_dict()}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=True)
        if state["drafter"] != self.config.to_json() or not same_map(state["token_map"], self.token_map):
            raise ValueError(f"{path} was trained with other drafter settings or another token map; "
                             "train with the same flags or drop --resume")
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(state["weights"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed = state["step"], state["elapsed"]

    # ---- calibration and export ------------------------------------------------------------------
    @torch.no_grad()
    def calibrate(self, examples: list[Example]) -> tuple[float, ...]:
        """DSPARK's confidence temperatures T_k, fitted on held-out examples (DFLASH has none)."""
        if self.config.algorithm != "DSPARK" or not examples:
            return ()
        logits, targets, valid = [], [], []
        B = self.cfg.batch_size
        for i in tqdm(range(0, len(examples), B), desc="calibrate", unit="batch"):
            batch = make_batch(examples[i:i + B])
            out = self.forward(batch, *sample_anchors(batch, self.cfg.anchors, seeded(self.cfg.seed, 3, i)))
            logits.append(out.confidence_logits.float())
            targets.append(acceptance(out.draft_logits.float().softmax(-1), out.target_probs.float()))
            valid.append(out.valid)
        return fit_temperatures(torch.cat(logits), torch.cat(targets), torch.cat(valid))

    def checkpoint(self, temperatures: tuple[float, ...] = ()) -> BlockDrafterCheckpoint | EagleCheckpoint:
        if isinstance(self.config, EagleConfig):
            return EagleCheckpoint(self.config, {k: p.detach().clone() for k, p in self.params.items()},
                                   "trained drafter")
        config = dataclasses.replace(self.config, confidence_temperatures=temperatures or
                                     self.config.confidence_temperatures)
        weights = {k: p.detach().clone() for k, p in self.params.items()}
        if self.token_map is not None:
            weights["token_map"] = self.token_map.long()
        return BlockDrafterCheckpoint(config, weights, "trained drafter")


def same_map(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def saved_token_map(state_path: Path) -> torch.Tensor | None:
    return torch.load(state_path, weights_only=True)["token_map"]
