import gzip
import json

from specserve.bench.data import parse_humaneval


def test_parse_humaneval_fixture(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    records = [{"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"},
               {"task_id": "HumanEval/1", "prompt": "def g():\n", "entry_point": "g"}]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert [r["task_id"] for r in parse_humaneval(path)] == ["HumanEval/0", "HumanEval/1"]
