"""What a trained drafter's folder says about it: the greedy acceptance length it reaches through the
engine on held-out and benchmark prompts, and the README.md model card."""
from __future__ import annotations

from pathlib import Path

from specserve.engine import LLM
from specserve.loader import LoadedCheckpoint
from specserve.models.block_drafter import BlockDrafterCheckpoint, BlockDrafterConfig
from specserve.models.eagle import EagleCheckpoint, EagleConfig
from specserve.types import SamplingParams, SpecStats


def measure_acceptance(target: LoadedCheckpoint, folder: Path, config: BlockDrafterConfig | EagleConfig,
                       rows: int, dtype: str, workloads: dict[str, list[list[int]]],
                       max_new_tokens: int) -> dict[str, tuple[int, float]]:
    """Greedy acceptance length of the exported drafter on each workload's prompts (token ids), every
    block (EAGLE: chain of `rows` drafts) verified in full → {workload: (prompts, acceptance length)}."""
    window = {"EAGLE": {"speculative_num_draft_tokens": rows},
              "DSPARK": {"speculative_dspark_confidence_threshold": 0.0, "speculative_block_size": rows},
              }.get(config.algorithm, {"speculative_block_size": rows})
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    llm = LLM(checkpoint=target, dtype=dtype, speculative_algorithm=config.algorithm,
              speculative_draft_model_path=str(folder), max_model_len=longest + max_new_tokens + 1, **window)
    table = {}
    for name, prompts in workloads.items():
        stats = SpecStats()
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        for out in llm.generate(prompts, params, use_tqdm=True):
            stats.merge(out.spec)
        table[name] = (len(prompts), stats.accept_length)
    return table


def model_card(ckpt: BlockDrafterCheckpoint | EagleCheckpoint, rows_per_step: int, summary: dict[str, str],
               acceptance_lengths: dict[str, tuple[int, float]], held_out: dict | None = None) -> str:
    c = ckpt.config
    eagle = isinstance(c, EagleConfig)
    params = sum(v.numel() for k, v in ckpt.weights.items() if k != "token_map")
    rows = [("algorithm", c.algorithm), ("target", c.target_name),
            ("draft layers", 1 if eagle else c.num_hidden_layers),
            ("hidden size", c.hidden_size), ("intermediate size", c.intermediate_size),
            ("attention heads (KV heads)", f"{c.num_attention_heads} ({c.num_key_value_heads})"),
            ("head dim", c.head_dim),
            ("parameters (embedding and LM head are the target's, not counted)", f"{params:,}"),
            ("target layer ids", list(c.target_layer_ids))]
    if eagle:
        rows += [("drafts per step (trained chain)", rows_per_step),
                 ("draft vocabulary", f"the target's {c.target_vocab_size:,}")]
    else:
        layout = ("DFlash's: the anchor's slot, then the mask slots, each drafting the token at its own position"
                  if c.anchor_slot else "row k drafts the token after it (the anchor's slot drafts the next token)")
        rows += [("block size", c.block_size), ("block slots", layout),
                 ("draft vocabulary", f"{c.draft_vocab_size:,} of {c.target_vocab_size:,}")]
    if c.algorithm == "DSPARK":
        rows += [("Markov rank", c.markov_rank),
                 ("confidence temperatures", ", ".join(f"{t:.3g}" for t in c.confidence_temperatures))]
    lines = [f"# {c.algorithm} drafter for {c.target_name}", "",
             "Trained with `specserve train-drafter`. Serve it with "
             f"`--speculative-algorithm {c.algorithm} --speculative-draft-model-path <this folder>`"
             + (f" `--speculative-num-draft-tokens {rows_per_step}`." if eagle else "."), "",
             "## Architecture", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
             "## Training", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in summary.items()), ""]
    if held_out:
        rows_shown = range(len(held_out["row_top1"]))
        lines += ["## Held-out rows", "",
                  f"Teacher-forced on {held_out['examples']} held-out answers, a block at every answer position "
                  f"({held_out['blocks']:,} blocks): row k's top-1 agreement with the target's greedy token after "
                  "position a + k, and the greedy acceptance length of a block (bonus token included), as the mean "
                  "over every anchor and along each answer (a block where the one before ended, as greedy decoding "
                  "meets them: what the engine's tokens per step come to; the mean over anchors overstates it, since "
                  "the engine crosses the stretches the drafter guesses in fewer steps). The bigram drafts the most "
                  "frequent next token of the training answers.", "",
                  "| drafter | " + " | ".join(f"row {k}" for k in rows_shown)
                  + " | acceptance length, every anchor | along the answers |",
                  "|---|" + "---|" * (len(rows_shown) + 2),
                  "| this | " + " | ".join(f"{x:.3f}" for x in held_out["row_top1"])
                  + f" | {held_out['accept_length']:.2f} | {held_out['walk_accept_length']:.2f} |",
                  "| count bigram | " + " | ".join(f"{x:.3f}" for x in held_out["bigram_row_top1"])
                  + f" | {held_out['bigram_accept_length']:.2f} | {held_out['bigram_walk_accept_length']:.2f} |", ""]
    if acceptance_lengths:
        lines += ["## Acceptance length", "",
                  f"Greedy decoding of first turns, {rows_per_step} drafts per step, every draft verified; acceptance "
                  "length = tokens emitted per target forward (bonus token included).", "",
                  "| workload | prompts | acceptance length |", "|---|---|---|",
                  *(f"| {name} | {n} | {tau:.2f} |" for name, (n, tau) in acceptance_lengths.items()), ""]
    return "\n".join(lines)
