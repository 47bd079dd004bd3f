"""The drafter trainer: batches of regenerated examples with what the target said about them (features.py:
its layers' streams and top-k next tokens, from the feature cache), block anchors (every answer position,
or a random subset), the drafter's tensors and optimizer (AdamW, warmup + cosine, gradient clipping),
checkpoints that resume bit for bit, a held-out row-accuracy report and the calibration of DSPARK's
confidence temperatures.

A step never runs the target: it runs every anchor's block through the drafter densely
(models/block_drafter.py `dense_block_forward`), the same computation as the engine's paged proposer:
the block at anchor a sees the context of positions < a and its own rows. Row k learns the target's
argmax after position a + k (cross-entropy) and its distribution (L1 distance against the top-k
probabilities; the tail beyond k counts as mass the draft cannot match, so the distance is an upper bound).
EAGLE trains the same way with block_size chain rows per anchor instead of a block (models/eagle.py
`dense_chain_forward`: each row feeds the next its own output feature, as when drafting), over the
target's full vocabulary; it has no token map, Markov or confidence head."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

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
from specserve.train.data import Example
from specserve.train.features import TargetFeatures
from specserve.train.losses import (
    LossTerms,
    LossWeights,
    TargetTopK,
    acceptance,
    block_loss,
    fit_temperatures,
    valid_rows,
)

Features = Callable[[list[int]], TargetFeatures]    # example indices → what the target said about them


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = "DSPARK"
    num_layers: int = 1
    block_size: int = 16               # block rows; EAGLE: chain rows (drafts per step)
    train_rows: int = 0                # rows a training step runs per anchor (0: block_size): the first rows
                                       # carry the loss, as drafts past the first few are rarely reached
    markov_rank: int = 64
    draft_vocab: int = 8192
    target_layer_ids: tuple[int, ...] | None = None     # None: 5 spread evenly (EAGLE: 3)
    context_norm: bool = True           # block drafters: RMS-normalise each target layer's stream before fc
    anchor_feature: bool = True         # block drafters: rows read the context vector before the anchor
    anchor_slot: bool | None = None     # block drafters: DFlash's layout (the anchor's slot drafts nothing);
                                        # None: DFLASH's own layout for DFLASH, DSPARK's for DSPARK
    target_top_k: int = 32              # target probabilities kept per position for the distribution loss
    markov_init: str = "bigram"         # DSPARK: "bigram" (rank-r SVD of the training answers' log P(next | prev))
                                        # or "random"
    max_steps: int = 2000
    time_budget: float | None = None    # seconds of training, across resumes; the LR follows whichever ends first
    batch_size: int = 4                 # sequences per step
    anchors: int = 0                    # blocks per sequence; 0: one at every answer position
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
    target: TargetFeatures             # [B, L, ...]

    def to(self, device: torch.device) -> Batch:
        t = self.target
        return Batch(self.tokens.to(device), self.lengths.to(device), self.prompt_lens.to(device),
                     TargetFeatures(t.aux.to(device), t.top_ids.to(device), t.top_probs.to(device)))


@dataclass(frozen=True)
class BlockOutputs:
    draft_logits: torch.Tensor               # [N, G, V_d] with the Markov term of the true previous token
    target: TargetTopK                       # [N, G, k] the target's likeliest tokens for the row
    target_ids: torch.Tensor                 # [N, G] draft id of the target's greedy token, -1 outside the map
    prev_ids: torch.Tensor                   # [N, G] the token at a + k that row k follows (target ids)
    valid: torch.Tensor                      # [N, G]
    confidence_logits: torch.Tensor | None   # [N, G] before the temperature (DSPARK)
    per_sequence: torch.Tensor               # [B] blocks of each sequence of the batch, in order (N in all)


def sequence(example: Example) -> list[int]:
    return example.prompt_ids + example.output_ids


def make_batch(examples: list[Example], target: TargetFeatures) -> Batch:
    seqs = [sequence(e) for e in examples]
    tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, seq in enumerate(seqs):
        tokens[b, :len(seq)] = torch.tensor(seq)
    if target.aux.shape[:2] != tokens.shape:
        raise ValueError(f"target features of shape {list(target.aux.shape[:2])} for a batch of {list(tokens.shape)}")
    return Batch(tokens, torch.tensor([len(s) for s in seqs]), torch.tensor([len(e.prompt_ids) for e in examples]),
                 target)


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
    """Up to `count` distinct random anchors per sequence (0: every one) → positions [B, A] and validity
    [B, A]. Anchors are answer tokens with a next token: the engine's first block follows the first
    generated token, whose context is the whole prompt."""
    starts = batch.prompt_lens.clamp_min(1)
    spans = (batch.lengths - 1 - starts).clamp_min(0)
    count = count or max(int(spans.max()), 1)
    anchors = torch.zeros(len(batch.lengths), count, dtype=torch.long)
    valid = torch.zeros(len(batch.lengths), count, dtype=torch.bool)
    for b, (start, span) in enumerate(zip(starts.tolist(), spans.tolist())):
        order = torch.randperm(span, generator=generator) if count < span else torch.arange(span)
        picks = start + order[:count].sort().values
        anchors[b, :len(picks)] = picks
        valid[b, :len(picks)] = True
    return anchors, valid


class DrafterTrainer:
    """A drafter's trainable tensors (Hugging Face layout), its optimizer and the target's frozen embedding
    and LM head, which the drafter shares. On `device` (a GPU, "cuda"), batches are moved there and the anchors
    are still drawn on the CPU, so a run picks the same blocks on either; the saved state loads on either (its
    weights on the CPU, its moments moved to the parameters' device), so a run resumes on either."""

    def __init__(self, target: LoadedCheckpoint, cfg: TrainConfig, token_map: torch.Tensor | None,
                 device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        dtype = DTYPES[cfg.dtype]
        self.autocast = dtype is torch.bfloat16
        self.dtype = torch.float32 if self.autocast else dtype
        tc = target.config
        self.embed = target.weights["model.embed_tokens.weight"].to(self.device, self.dtype)     # [vocab, hidden]
        if not 0 <= cfg.train_rows <= cfg.block_size:
            raise ValueError(f"--train-rows must be in [0, --block-size {cfg.block_size}] (0: the block size), "
                             f"got {cfg.train_rows}")
        if cfg.algorithm == "EAGLE":
            if token_map is not None or cfg.num_layers != 1 or cfg.anchor_slot:
                raise ValueError("an EAGLE head has one layer, drafts over the target's whole vocabulary "
                                 "(no token map) and has no block slots (no --anchor-slot)")
            init = random_eagle(tc, target_layer_ids=cfg.target_layer_ids, seed=cfg.seed, dtype=self.dtype)
        else:
            init = random_block_drafter(tc, cfg.algorithm, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                        target_layer_ids=cfg.target_layer_ids, markov_rank=cfg.markov_rank,
                                        token_map=token_map, context_norm=cfg.context_norm,
                                        anchor_feature=cfg.anchor_feature,
                                        anchor_slot=(cfg.algorithm == "DFLASH" if cfg.anchor_slot is None
                                                     else cfg.anchor_slot),
                                        seed=cfg.seed, dtype=self.dtype)
        self.config: BlockDrafterConfig | EagleConfig = init.config
        if cfg.max_len + cfg.block_size > tc.max_position_embeddings:
            raise ValueError(f"--max-len {cfg.max_len} plus the block size exceeds the target's "
                             f"{tc.max_position_embeddings} positions")
        self.token_map = token_map
        self.params = {k: torch.nn.Parameter(v.to(self.device)) for k, v in init.weights.items() if k != "token_map"}
        self.draft_ids = (torch.arange(tc.vocab_size) if token_map is None else token_map.long()).to(self.device)
        self.to_draft = torch.full((tc.vocab_size,), -1, dtype=torch.long, device=self.device)   # target → draft id
        self.to_draft[self.draft_ids] = torch.arange(len(self.draft_ids), device=self.device)
        # tokens outside the map take the Markov head's extra all-zero row, as in the engine
        self.markov_index = torch.where(self.to_draft >= 0, self.to_draft, len(self.draft_ids))
        head = self.embed if tc.tie_word_embeddings else target.weights["lm_head.weight"].to(self.device, self.dtype)
        self.head = head[self.draft_ids].T.contiguous()                          # [hidden, V_d], frozen
        self.rope = Rope(self.config.head_dim, self.config.rope_theta, tc.max_position_embeddings, self.dtype,
                         self.device)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        self.step = 0
        self.elapsed = 0.0

    @torch.no_grad()
    def init_from(self, ckpt: BlockDrafterCheckpoint | EagleCheckpoint) -> None:
        """Start from an exported drafter's weights (a fresh optimizer; the run takes its token map): a new
        run continues where a shipped drafter stopped, with the same settings."""
        theirs, ours = ckpt.config.to_json(), self.config.to_json()
        differ = [k for k in ours if k != "confidence_temperatures" and theirs.get(k) != ours[k]]
        if differ:
            raise ValueError(f"{ckpt.source} was exported with other drafter settings ("
                             + ", ".join(f"{k} {theirs.get(k)} instead of {ours[k]}" for k in differ)
                             + "); train with the same flags")
        for name, p in self.params.items():
            p.copy_(ckpt.weights[name])

    @torch.no_grad()
    def init_markov_from_bigram(self, examples: list[Example]) -> None:
        """DSPARK's Markov head as the best rank-r fit of the count bigram on the draft vocabulary: w2 ·
        w1[prev] ≈ log P(next | prev) - its mean over next (add-one smoothing; tokens outside the map are
        left out), so that training starts from what a bigram table knows."""
        V = len(self.draft_ids)
        to_draft = self.to_draft.cpu()
        prev, nxt = (to_draft[ids] for ids in answer_bigrams(examples))
        keep = (prev >= 0) & (nxt >= 0)
        counts = torch.ones(V, V).index_put_((prev[keep], nxt[keep]), torch.ones(int(keep.sum())), accumulate=True)
        log_p = counts.log() - counts.sum(1, keepdim=True).log()
        centred = log_p - log_p.mean(1, keepdim=True)
        r = self.params["markov.w1.weight"].shape[1]
        u, sv, v = torch.svd_lowrank(centred, q=r, niter=4)
        self.params["markov.w1.weight"].copy_(u * sv.sqrt())                # [V_d, r]
        self.params["markov.w2.weight"].copy_(v * sv.sqrt())                # [V_d, r]

    # ---- forward ---------------------------------------------------------------------------------
    def on_device(self) -> contextlib.AbstractContextManager:
        """Tensors made without a device inside (aranges, masks, loss terms) go to the trainer's device; on the CPU
        no mode is entered, as it would cost an interpreted call per op."""
        return contextlib.nullcontext() if self.device.type == "cpu" else self.device

    def target_top_k(self, batch: Batch, positions: torch.Tensor) -> TargetTopK:   # [B, A, G] → [B, A, G, k]
        """The target's likeliest tokens after each row's position, in draft ids."""
        inside = positions.clamp(max=batch.tokens.shape[1] - 1).flatten(1)
        k = batch.target.top_ids.shape[-1]

        def at(t: torch.Tensor) -> torch.Tensor:                               # [B, L, k] → [B, A, G, k]
            return t.gather(1, inside[..., None].expand(-1, -1, k)).view(*positions.shape, k)

        return TargetTopK(self.to_draft[at(batch.target.top_ids)], at(batch.target.top_probs))

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

    def forward(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                rows: int | None = None) -> BlockOutputs:
        """The block of every valid anchor ([B, A] positions; the valid ones a prefix of each row) with its
        targets, its first `rows` rows (default: the whole block), flattened to N blocks in batch order. Block
        drafters run one sequence at a time, unpadded: with a block at every answer position, padding would
        be ~40% of the rows."""
        with self.on_device():
            return self._forward(batch.to(self.device), anchors.to(self.device), anchor_valid.to(self.device),
                                 batch.lengths, anchor_valid.sum(1), rows)

    def _forward(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor, lengths: torch.Tensor,
                 per_sequence: torch.Tensor, rows: int | None) -> BlockOutputs:
        """forward on the trainer's device; lengths, per_sequence: [B] each sequence's tokens and blocks, on the
        CPU (read without waiting for the device)."""
        G = rows or self.cfg.block_size
        aux = batch.target.aux.to(self.dtype)
        positions = anchors[..., None] + torch.arange(G)                       # [B, A, G] row positions
        valid = valid_rows(anchors, anchor_valid, batch.lengths, G)
        inside = positions.clamp(max=batch.tokens.shape[1] - 1).flatten(1)
        prev = batch.tokens.gather(1, inside).view_as(positions)                # row k: the token at a + k
        top = self.target_top_k(batch, positions)                               # and the target's next ones
        target = TargetTopK(top.ids[anchor_valid], top.probs[anchor_valid])
        with torch.autocast(self.device.type, torch.bfloat16) if self.autocast else contextlib.nullcontext():
            if self.config.algorithm == "EAGLE":
                hidden = dense_chain_forward(self.config, self.params, self.embed, self.rope, aux, batch.tokens,
                                             anchors, G)[anchor_valid]
            else:
                hidden = torch.cat([dense_block_forward(self.config, self.params, self.embed, self.rope,
                                                        aux[b:b + 1, :length], anchors[b:b + 1, :n],
                                                        prev[b:b + 1, :n, 0], G)[0]
                                    for b, (length, n) in enumerate(zip(lengths.tolist(), per_sequence.tolist()))
                                    if n])
            logits, confidence = self.heads(hidden, prev[anchor_valid])
        return BlockOutputs(logits, target, target.ids[..., 0], prev[anchor_valid], valid[anchor_valid], confidence,
                            per_sequence)

    def losses(self, batch: Batch, generator: torch.Generator) -> LossTerms:
        out = self.forward(batch, *sample_anchors(batch, self.cfg.anchors, generator), self.cfg.train_rows)
        with self.on_device():
            return block_loss(out.draft_logits, out.target, out.target_ids, out.valid, out.confidence_logits,
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

    def train(self, examples: list[Example], features: Features, state_path: Path, until: int | None = None,
              log_path: Path | None = None) -> None:
        """Train up to step `until` (default max_steps) or the time budget, saving the state every
        save_every steps and at the end. `features` gives the target's view of examples by index."""
        cfg = self.cfg
        until = min(until or cfg.max_steps, cfg.max_steps)
        start, elapsed_before = time.perf_counter(), self.elapsed
        running: dict[str, float] = {}
        rows = 0
        with tqdm(initial=self.step, total=until, desc=f"train {self.config.algorithm}", unit="step") as bar:
            while self.step < until and not self.out_of_time():
                indices = batch_indices(len(examples), cfg.batch_size, self.step, cfg.seed)
                batch = make_batch([examples[i] for i in indices], features(indices))
                terms, lr = self.train_step(batch)
                self.elapsed = elapsed_before + time.perf_counter() - start
                rows += terms.rows
                now = {"loss": terms.total.item(), "acc": terms.acceptance, "tau": terms.accept_length,
                       "rows/s": rows / max(self.elapsed - elapsed_before, 1e-9)}
                running = {k: v if k not in running else 0.9 * running[k] + 0.1 * v for k, v in now.items()}
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in running.items()})
                if log_path is not None:
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": self.step, "lr": lr, "elapsed": round(self.elapsed, 2),
                                            "tokens": int(batch.lengths.sum()), "rows": terms.rows,
                                            **{k: getattr(terms, k) for k in ("ce", "dist", "confidence",
                                                                              "acceptance", "accept_length")},
                                            "loss": terms.total.item()}) + "\n")
                if self.step % cfg.save_every == 0:
                    self.save(state_path)
        self.save(state_path)

    # ---- state -----------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        state = {"step": self.step, "elapsed": self.elapsed, "drafter": self.config.to_json(),
                 "token_map": self.token_map, "weights": {k: p.detach().cpu() for k, p in self.params.items()},
                 "optimizer": self.optimizer.state_dict()}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=True, map_location="cpu")
        if state["drafter"] != self.config.to_json() or not same_map(state["token_map"], self.token_map):
            raise ValueError(f"{path} was trained with other drafter settings or another token map; "
                             "train with the same flags or drop --resume")
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(state["weights"][k])
        self.optimizer.load_state_dict(state["optimizer"])       # its moments move to the parameters' device
        self.step, self.elapsed = state["step"], state["elapsed"]

    # ---- calibration and export ------------------------------------------------------------------
    def held_out(self, examples: list[Example], features: Features, desc: str) -> Iterator[BlockOutputs]:
        """Every anchor's block of each held-out example, a batch at a time."""
        B = self.cfg.batch_size
        for i in tqdm(range(0, len(examples), B), desc=desc, unit="batch"):
            indices = list(range(i, min(i + B, len(examples))))
            batch = make_batch([examples[j] for j in indices], features(indices))
            yield self.forward(batch, *sample_anchors(batch, 0, seeded(self.cfg.seed, 3, i)))

    @torch.no_grad()
    def calibrate(self, examples: list[Example], features: Features) -> tuple[float, ...]:
        """DSPARK's confidence temperatures T_k, fitted on held-out examples (DFLASH has none)."""
        if self.config.algorithm != "DSPARK" or not examples:
            return ()
        logits, targets, valid = [], [], []
        for out in self.held_out(examples, features, "calibrate"):
            logits.append(out.confidence_logits.float().cpu())
            with self.on_device():
                targets.append(acceptance(out.draft_logits.float().log_softmax(-1), out.target).cpu())
            valid.append(out.valid.cpu())
        return fit_temperatures(torch.cat(logits), torch.cat(targets), torch.cat(valid))

    @torch.no_grad()
    def evaluate(self, examples: list[Example], features: Features, bigram: torch.Tensor) -> dict:
        """Teacher-forced on held-out examples, every anchor: each row's top-1 agreement with the target's
        greedy token, and the greedy acceptance length of a block (bonus token included); the same for a
        count bigram (`bigram`: [vocab] the most frequent next token after each token in the training
        answers), which drafts row k from the true token at a + k."""
        G = self.cfg.block_size
        hits, bigram_hits, rows = torch.zeros(G), torch.zeros(G), torch.zeros(G)
        lengths, bigram_lengths, per_sequence = [], [], []
        bigram = bigram.to(self.device)
        for out in self.held_out(examples, features, "evaluate"):
            per_sequence += out.per_sequence.tolist()
            valid = (out.valid & (out.target_ids >= 0)).cpu()
            target_ids = out.target_ids.cpu()
            match = (out.draft_logits.argmax(-1).cpu() == target_ids) & valid
            bigram_match = (self.to_draft[bigram[out.prev_ids]].cpu() == target_ids) & valid
            hits += match.sum(0)
            bigram_hits += bigram_match.sum(0)
            rows += valid.sum(0)
            blocks = out.valid[:, 0].cpu()
            lengths.append(1 + match.long().cumprod(-1).sum(-1)[blocks])
            bigram_lengths.append(1 + bigram_match.long().cumprod(-1).sum(-1)[blocks])
        rows = rows.clamp_min(1)
        return {"examples": len(examples), "blocks": int(sum(len(x) for x in lengths)),
                "row_top1": [round(x, 4) for x in (hits / rows).tolist()],
                "accept_length": round(float(torch.cat(lengths).double().mean()), 4),
                "walk_accept_length": walk_accept_length(torch.cat(lengths), per_sequence),
                "bigram_row_top1": [round(x, 4) for x in (bigram_hits / rows).tolist()],
                "bigram_accept_length": round(float(torch.cat(bigram_lengths).double().mean()), 4),
                "bigram_walk_accept_length": walk_accept_length(torch.cat(bigram_lengths), per_sequence)}

    def checkpoint(self, temperatures: tuple[float, ...] = ()) -> BlockDrafterCheckpoint | EagleCheckpoint:
        if isinstance(self.config, EagleConfig):
            return EagleCheckpoint(self.config, {k: p.detach().to("cpu", copy=True) for k, p in self.params.items()},
                                   "trained drafter")
        config = dataclasses.replace(self.config, confidence_temperatures=temperatures or
                                     self.config.confidence_temperatures)
        weights = {k: p.detach().to("cpu", copy=True) for k, p in self.params.items()}
        if self.token_map is not None:
            weights["token_map"] = self.token_map.long()
        return BlockDrafterCheckpoint(config, weights, "trained drafter")


def walk_accept_length(lengths: torch.Tensor, per_sequence: list[int]) -> float:
    """Tokens per step of greedy decoding along each answer: the first block at the first anchor, each next one
    where the block before's accepted drafts and bonus token end, as the engine's blocks fall. lengths: [blocks]
    each anchor's acceptance length, `per_sequence[i]` of them for answer i in turn. The mean over every anchor
    weighs the anchors of a stretch the drafter guesses as much as those of one it does not, which the engine
    crosses in fewer steps, and overstates the engine's tokens per step: the stage-10 drafter's 64 held-out answers
    give 1.97 over every anchor and 1.79 along them; on eight answers the engine wrote, 1.59 along them against the
    1.575 the engine measured writing them."""
    tokens = steps = 0
    for part in lengths.split(per_sequence):
        walk = part.tolist()
        i = 0
        while i < len(walk):
            tokens += walk[i]
            steps += 1
            i += walk[i]
    return round(tokens / max(steps, 1), 4)


def same_map(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def saved_token_map(state_path: Path) -> torch.Tensor | None:
    return torch.load(state_path, weights_only=True, map_location="cpu")["token_map"]


def answer_bigrams(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of consecutive answer tokens: (previous ids, next ids), [pairs] each."""
    answers = [torch.tensor(e.output_ids) for e in examples if len(e.output_ids) > 1]
    return torch.cat([a[:-1] for a in answers]), torch.cat([a[1:] for a in answers])


def count_bigram(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """[vocab] the most frequent next token after each token in the examples' answers (ties to the lower
    id; a token never seen before another maps to itself)."""
    prev, nxt = answer_bigrams(examples)
    pairs = prev * vocab_size + nxt
    keys, counts = pairs.unique(return_counts=True)
    order = torch.sort(keys // vocab_size * (counts.max() + 1) - counts, stable=True).indices   # by prev, most first
    keys = keys[order]
    prev = keys // vocab_size
    first = torch.ones_like(prev, dtype=torch.bool)
    first[1:] = prev[1:] != prev[:-1]
    table = torch.arange(vocab_size)
    table[prev[first]] = keys[first] % vocab_size
    return table
