import hashlib
import os

import pytest
import torch

import specserve.loader.cache as cache
from specserve.loader import load_checkpoint
from tests.gguf_writer import make_tiny_gguf

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def forbid_conversion(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the GGUF was converted again instead of read from the cache")
    monkeypatch.setattr("specserve.loader.gguf.load_gguf", fail)


def assert_same(a, b):
    assert a.config == b.config and a.source == b.source
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.tokenizer.encode("hello world") == b.tokenizer.encode("hello world")
    assert a.tokenizer.apply_chat_template(MESSAGES, tokenize=False) == b.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False)


def test_warm_load_reads_cache(tmp_path, cache_dir, monkeypatch):
    path = str(tmp_path / "m.gguf")
    make_tiny_gguf(tmp_path / "m.gguf", "qwen2")
    cold = load_checkpoint(path)
    entry = cache.entry_dir(path, torch.float32)
    assert entry.parent.parent == cache_dir and entry.name == "float32"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert not list(entry.parent.glob(".tmp-*"))
    forbid_conversion(monkeypatch)
    assert_same(load_checkpoint(path), cold)


def test_cache_keyed_by_dtype(tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    make_tiny_gguf(tmp_path / "m.gguf")
    f32, bf16 = load_checkpoint(path), load_checkpoint(path, dtype=torch.bfloat16)
    assert cache.entry_dir(path, torch.bfloat16).is_dir() and cache.entry_dir(path, torch.float32).is_dir()
    forbid_conversion(monkeypatch)
    assert_same(load_checkpoint(path, dtype=torch.bfloat16), bf16)
    assert {w.dtype for w in bf16.weights.values()} == {torch.bfloat16}
    assert_same(load_checkpoint(path), f32)


def test_hash_memoized_until_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    real_sha256, calls = hashlib.sha256, []
    monkeypatch.setattr(cache.hashlib, "sha256", lambda: calls.append(1) or real_sha256())
    want = real_sha256(b"abc").hexdigest()
    assert cache.file_sha256(path) == want and cache.file_sha256(path) == want and len(calls) == 1
    path.write_bytes(b"abcd")
    os.utime(path, ns=(1, 1))
    assert cache.file_sha256(path) == real_sha256(b"abcd").hexdigest() and len(calls) == 2


def test_damaged_entry_is_rebuilt(tmp_path):
    path = str(tmp_path / "m.gguf")
    make_tiny_gguf(tmp_path / "m.gguf")
    cold = load_checkpoint(path)
    weights = cache.entry_dir(path, torch.float32) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert_same(load_checkpoint(path), cold)
    assert weights.stat().st_size > 100


def test_use_cache_false_writes_nothing(tmp_path, cache_dir):
    make_tiny_gguf(tmp_path / "m.gguf")
    load_checkpoint(str(tmp_path / "m.gguf"), use_cache=False)
    assert not cache_dir.exists()


@pytest.mark.real_model
def test_smollm2_warm_equals_cold(monkeypatch):
    cold = load_checkpoint(None)
    forbid_conversion(monkeypatch)
    assert_same(load_checkpoint(None), cold)
