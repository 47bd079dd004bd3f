"""The command line: JSON output on a tiny model saved to disk, structured output, and one-line errors with
exit code 2."""
import json
import subprocess
import sys

import pytest
import torch

from specserve import drafters
from specserve.cli import main, parse_args
from specserve.config import engine_kwargs
from specserve.drafters import with_shipped_drafter
from tests.conftest import save_hf_folder, tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_hf_folder(tiny_checkpoint("llama"), tmp_path_factory.mktemp("tiny"), torch.float32)


def test_generate_json(tiny_folder, capsys):
    rc = main(["generate", "--model-path", str(tiny_folder), "--json", "--no-chat", "--max-new-tokens", "5",
               "--ignore-eos", "hello", "world"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        record = json.loads(line)
        assert set(record) >= {"text", "token_ids", "finish_reason", "num_tokens", "tokens_per_s"}
        assert record["num_tokens"] == 5 == len(record["token_ids"]) and record["finish_reason"] == "length"


def test_generate_follows_a_grammar(tiny_folder, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    for flag, value, check in (("--regex", "(yes|no)", lambda t: t in ("yes", "no")),
                               ("--json-schema", f"@{schema}", lambda t: isinstance(json.loads(t)["ok"], bool)),
                               ("--ebnf", 'root ::= "x" [0-9]', lambda t: len(t) == 2 and t[0] == "x")):
        assert main(["generate", "--model-path", str(tiny_folder), "--json", "--max-new-tokens", "40", flag, value,
                     "hello"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["finish_reason"] == "stop" and check(record["text"]), record["text"]


@pytest.mark.parametrize("args, message", [
    (["--regex", "(ab", "hi"], "regex: not a valid regex"),
    (["--model-path", "/no/such/model.gguf", "hi"], "does not exist"),
    (["--max-new-tokens", "0", "hi"], "max_new_tokens"),
    (["--temperature", "-1", "hi"], "temperature"),
    (["--top-p", "1.5", "hi"], "top_p"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tiny_folder):
    if "--model-path" not in args:
        args = ["--model-path", str(tiny_folder), *args]
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]


def test_corrupt_model_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "--model-path", str(bad), "hi"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "corrupt or truncated" in proc.stderr


def serve_kwargs(*argv: str) -> dict:
    args = parse_args(["serve", *argv])
    return with_shipped_drafter(engine_kwargs(args))


def test_serve_defaults_to_the_embedded_dspark_pair(monkeypatch, tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    monkeypatch.setattr(drafters, "EMBEDDED_DSPARK", drafter)
    kw = serve_kwargs()
    assert kw["speculative_algorithm"] == "DSPARK" and kw["speculative_draft_model_path"] == str(drafter)
    assert kw["speculative_ngram_hybrid"]
    assert serve_kwargs("--speculative-algorithm", "DSPARK")["speculative_draft_model_path"] == str(drafter)
    assert serve_kwargs("--speculative-algorithm", "NONE")["speculative_algorithm"] == "NONE"
    other = serve_kwargs("--model-path", "other.gguf")
    assert other["speculative_algorithm"] == "NONE" and other["speculative_draft_model_path"] is None
    assert parse_args(["serve", "--disable-radix-cache"]).disable_radix_cache
    monkeypatch.setattr(drafters, "EMBEDDED_DSPARK", tmp_path / "absent")
    assert serve_kwargs()["speculative_algorithm"] == "NONE"


def test_profile_args_parse():
    args = parse_args(["profile", "--rows", "1", "8", "--repeats", "2", "--out", "x.json", "--threads", "1"])
    assert (args.rows, args.repeats, args.out, args.num_threads, args.page_size) == ([1, 8], 2, "x.json", 1, 16)
    assert args.model_path is None and args.dtype == "float32"


def test_a_command_imports_only_its_own_modules():
    """`generate --help` parses without the server, the trainer or the benchmark being imported."""
    code = ("import sys\nfrom specserve.cli import parse_args\n"
            "try:\n    parse_args(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith(('specserve.train', 'specserve.server', "
            "'specserve.bench', 'specserve.engine'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "--speculative-block-size" in proc.stdout and "--max-new-tokens" in proc.stdout
