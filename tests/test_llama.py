"""Parity of our Llama-family model against transformers' own implementation on the same weights."""
import pytest
import torch
import transformers

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import ModelConfig
from specserve.kv_pages import KVGeometry, KVPool
from specserve.models.layers import rms_norm
from specserve.models.llama import DecoderStack, LlamaModel

PROMPTS = [[1, 5, 7, 9, 11, 13, 2], [3, 4, 5], [8, 8, 8, 8, 8, 8, 8, 8, 8, 1]]


def run_batch(model: LlamaModel, prompts: list[list[int]], page_size: int = 4) -> list[torch.Tensor]:
    """Prefill all prompts but the last token as one ragged batch, then decode the last tokens together."""
    cfg = model.config
    pool = KVPool(KVGeometry.of(cfg, model.dtype), 64, page_size)
    pages, next_page = [], 0
    for p in prompts:
        n = -(-len(p) // page_size)
        pages.append(list(range(next_page, next_page + n))[::-1])   # out-of-order pages on purpose
        next_page += n
    heads = [p[:-1] for p in prompts]
    meta = AttentionMetadata.build([SeqSpan(pg, 0, len(h)) for pg, h in zip(pages, heads)], page_size, pool.null_slot)
    hidden, _ = model.forward(torch.tensor(sum(heads, [])), torch.tensor([i for h in heads for i in range(len(h))]),
                              meta, pool)
    logits = model.logits(hidden).split([len(h) for h in heads])
    meta = AttentionMetadata.build([SeqSpan(pg, len(h), 1) for pg, h in zip(pages, heads)], page_size, pool.null_slot)
    hidden, _ = model.forward(torch.tensor([p[-1] for p in prompts]), torch.tensor([len(h) for h in heads]), meta, pool)
    last = model.logits(hidden)
    return [torch.cat([lg, last[i:i + 1]]) for i, lg in enumerate(logits)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_matches_transformers_on_tiny_random_model(arch):
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)
    hf_cls, hf_cfg = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**kw, tie_word_embeddings=True)),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**kw, tie_word_embeddings=False)),
        "qwen3": (transformers.Qwen3ForCausalLM,
                  transformers.Qwen3Config(**kw, head_dim=16, tie_word_embeddings=False)),
    }[arch]
    hf = hf_cls(hf_cfg).eval()
    weights = hf.state_dict()
    for name, tensor in weights.items():
        if name.endswith("bias"):
            tensor.normal_(0, 0.5)     # Qwen2 initialises QKV biases to zero; make them matter
    cfg = ModelConfig(arch, 97, 64, 96, 3, 4, 2, 16, 1e-6, 10000.0, 128, tie_word_embeddings=arch == "llama",
                      qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    ours = run_batch(LlamaModel(cfg, weights, torch.float32), PROMPTS)
    with torch.no_grad():
        for prompt, logits in zip(PROMPTS, ours):
            ref = hf(torch.tensor([prompt])).logits[0]
            assert (ref - logits).abs().max().item() < 1e-3


def test_aux_hidden_states_are_the_residual_stream_after_each_layer():
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=10000.0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = ModelConfig("llama", 97, 64, 96, 3, 4, 2, 16, hf_cfg.rms_norm_eps, 10000.0, 128,
                      tie_word_embeddings=hf_cfg.tie_word_embeddings)
    model = LlamaModel(cfg, hf.state_dict(), torch.float32)
    prompt = PROMPTS[0]
    pool = KVPool(KVGeometry.of(cfg, torch.float32), 4, 16)
    meta = AttentionMetadata.build([SeqSpan([0], 0, len(prompt))], 16, pool.null_slot)
    _, aux = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), meta, pool, aux_layer_ids=(0, 1))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for mine, theirs in zip(aux, ref[1:3]):      # hidden_states[0] is the embedding output
        assert (mine - theirs[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("quantization,dtype",
                         [("none", torch.float64), ("none", torch.float32), ("int8", torch.float32)])
def test_scripted_layer_stack_equals_the_eager_layers_bit_for_bit(quantization, dtype):
    """The layers run under TorchScript for speed; the interpreter must not change a single bit."""
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)).eval()
    cfg = ModelConfig("qwen2", 97, 64, 96, 2, 4, 2, 16, 1e-6, 10000.0, 128, qkv_bias=True)
    model = LlamaModel(cfg, hf.state_dict(), dtype, quantization=quantization)
    assert isinstance(model.stack, torch.jit.ScriptModule)
    outs = []
    for stack in (model.stack, DecoderStack(model.layers)):
        pool = KVPool(KVGeometry.of(cfg, dtype), 8, 4)      # float32: the row-invariant kernel's path
        steps = [(SeqSpan([3, 1, 0], 0, 7), PROMPTS[0]), (SeqSpan([3, 1, 0], 7, 3), [4, 5, 6])]   # prefill, window
        for span, ids in steps:
            meta = AttentionMetadata.for_pool([span], pool)
            positions = torch.arange(span.start, span.start + span.num_new)
            cos, sin = model.rope.tables(positions)
            x, aux = stack(model.embed[torch.tensor(ids)], cos, sin, pool.k_layers, pool.v_layers, meta.slot_mapping,
                           list(meta.chunks), meta.rows, [0])
            outs.append((x, aux[0]))
    half = len(outs) // 2
    for (x, aux), (x_eager, aux_eager) in zip(outs[:half], outs[half:]):
        assert torch.equal(x, x_eager) and torch.equal(aux, aux_eager)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_stack_equals_the_scripted_stack_bit_for_bit(arch, kv_dtype, threads):
    """int8 float32 layers run as one native call; it must compute the scripted stack's bits: hidden states, aux
    layers and every K/V it writes, over prefills (one longer than the attention's 16-row groups), a verify window and a
    batch of two sequences, on one thread and on two."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _native_stack_equals_the_scripted_stack(arch, kv_dtype)
    finally:
        torch.set_num_threads(previous)


def _native_stack_equals_the_scripted_stack(arch, kv_dtype):
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
    hf = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)) if arch == "llama" else
          transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw, tie_word_embeddings=False))).eval()
    weights = {name: t.normal_(0, 0.5) if name.endswith("bias") else t for name, t in hf.state_dict().items()}
    cfg = ModelConfig(arch, 97, 64, 96, 3, 4, 2, 16, 1e-6, 10000.0, 128, qkv_bias=arch == "qwen2",
                      tie_word_embeddings=arch == "llama")
    model = LlamaModel(cfg, weights, torch.float32, quantization="int8")
    assert model.native_stack is not None
    steps = [[(SeqSpan([3, 1, 0], 0, 7), PROMPTS[0])],                                   # prefill
             [(SeqSpan([3, 1, 0], 7, 3), [4, 5, 6]), (SeqSpan([5, 4], 0, 5), [9, 8, 7, 6, 5])],   # window + prefill
             [(SeqSpan([3, 1, 0], 10, 1), [2]), (SeqSpan([5, 4], 5, 2), [1, 2])],
             [(SeqSpan([8, 9, 10, 11, 12], 0, 19), list(range(10, 29)))]]                  # 19 rows
    runs = []
    for native in (True, False):
        pool = KVPool(KVGeometry.of(cfg, kv_dtype), 16, 4)
        outs = []
        for step in steps:
            meta = AttentionMetadata.for_pool([span for span, _ in step], pool)
            positions = torch.cat([torch.arange(span.start, span.start + span.num_new) for span, _ in step])
            x = model.embed[torch.tensor([t for _, ids in step for t in ids])]
            if native:
                outs.append(model.forward_embeds(x, positions, meta, pool, aux_layer_ids=(0, 2)))
            else:
                cos, sin = model.rope.tables(positions)
                hidden, aux = model.stack(x, cos, sin, pool.k_layers, pool.v_layers, meta.slot_mapping,
                                          list(meta.chunks), meta.rows, [0, 2])
                outs.append((rms_norm(hidden, model.final_norm, cfg.rms_norm_eps), aux))
        runs.append((outs, pool))
    (native_outs, native_pool), (scripted_outs, scripted_pool) = runs
    for (x, aux), (x_ref, aux_ref) in zip(native_outs, scripted_outs):
        assert torch.equal(x, x_ref) and len(aux) == 2 and all(map(torch.equal, aux, aux_ref))
    assert torch.equal(native_pool.k, scripted_pool.k) and torch.equal(native_pool.v, scripted_pool.v)


def test_no_native_stack_where_an_op_has_no_kernel_in_it():
    """qk-norm (Qwen3) and float32 linears take the scripted stack."""
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)).eval()
    cfg = ModelConfig("qwen3", 97, 64, 96, 2, 4, 2, 16, 1e-6, 10000.0, 128, qk_norm=True)
    assert LlamaModel(cfg, hf.state_dict(), torch.float32, quantization="int8").native_stack is None
    llama_cfg = ModelConfig("llama", 97, 64, 96, 2, 4, 2, 16, 1e-6, 10000.0, 128)
    weights = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)).state_dict()
    assert LlamaModel(llama_cfg, weights, torch.float32).native_stack is None


def test_int8_weights_share_one_huge_page_arena_in_forward_order():
    """The int8 weights of the layers and the head are copied into one arena, in the order a forward reads them."""
    torch.manual_seed(0)
    cfg = ModelConfig("llama", 97, 64, 96, 2, 4, 2, 16, 1e-6, 10000.0, 128)
    weights = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)).state_dict()
    model = LlamaModel(cfg, weights, torch.float32, quantization="int8")
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.head]
    starts = [lin.weight.data_ptr() for lin in linears]
    assert len({lin.weight.untyped_storage().data_ptr() for lin in linears}) == 1
    assert starts == sorted(starts)
