import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specserve.loader import ModelLoadError, load_checkpoint

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"


def save_tiny_model(folder: Path, arch: str, max_shard_size: str | None = None, tied: bool = False) -> dict:
    torch.manual_seed(0)
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=[1, 2], tie_word_embeddings=tied)
    classes = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
               "qwen3": (Qwen3ForCausalLM, Qwen3Config)}
    model_class, config_class = classes[arch]
    model = model_class(config_class(**common))
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    vocab = {c: i for i, c in enumerate("<>|abcdefghijklmnopqrstuvwxyz ,.!?0123")}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch,shard,tied", [("llama", None, True), ("llama", "40KB", False),
                                             ("qwen2", None, False), ("qwen2", "40KB", True),
                                             ("qwen3", None, True)])
def test_folder_round_trip(tmp_path, arch, shard, tied):
    original = save_tiny_model(tmp_path, arch, shard, tied)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    ckpt = load_checkpoint(str(tmp_path))
    c = ckpt.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (arch, 40, 32, 48, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.max_position_embeddings) == (4, 2, 8, 1e-6, 128)
    assert (c.tie_word_embeddings, c.qkv_bias, c.qk_norm) == (tied, arch == "qwen2", arch == "qwen3")
    assert (c.bos_token_id, c.eos_token_ids) == (0, (1, 2))
    assert ckpt.source == str(tmp_path)
    expected = {k: v for k, v in original.items() if not (tied and k == "lm_head.weight")}
    assert ckpt.weights.keys() == expected.keys()
    for name, w in expected.items():
        assert torch.equal(ckpt.weights[name], w), name
    assert ckpt.tokenizer.chat_template == CHAT_TEMPLATE
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("hello, world!")).replace(" ", "") == "hello,world!"


def test_folder_dtype(tmp_path):
    original = save_tiny_model(tmp_path, "qwen2")
    ckpt = load_checkpoint(str(tmp_path), dtype=torch.bfloat16)
    assert torch.equal(ckpt.weights["model.embed_tokens.weight"], original["model.embed_tokens.weight"].bfloat16())


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_checkpoint(str(tmp_path))


def test_unsupported_class(tmp_path):
    save_tiny_model(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="architecture GPT2LMHeadModel is not supported"):
        load_checkpoint(str(tmp_path))


def test_corrupt_config(tmp_path):
    save_tiny_model(tmp_path, "llama")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is corrupt"):
        load_checkpoint(str(tmp_path))


def test_truncated_weights(tmp_path):
    save_tiny_model(tmp_path, "llama")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors is missing, corrupt or truncated"):
        load_checkpoint(str(tmp_path))


def test_missing_shard(tmp_path):
    save_tiny_model(tmp_path, "qwen2", "40KB")
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="is missing, corrupt or truncated"):
        load_checkpoint(str(tmp_path))


def test_missing_weights(tmp_path):
    save_tiny_model(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no \\*.safetensors weights"):
        load_checkpoint(str(tmp_path))


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_model(tmp_path, "llama")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 tensors .e.g. model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(str(tmp_path))
