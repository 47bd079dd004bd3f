"""int8 linears: per-row weight quantization, per-token activations whose result does not depend on the
batch (bit for bit), accuracy against the float product, and the engine's choice of quantization."""
from __future__ import annotations

import logging

import pytest
import torch

from specserve import native
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.engine import LLM
from specserve.kv_pages import KVGeometry, KVPool
from specserve.models.layers import Linear
from specserve.models.llama import LlamaModel
from specserve.native.ops import int8_linear as reference
from specserve.native.ops import pack, unpack
from specserve.quantization import WEIGHT_MAX, Int8Linear, quantize_rows
from tests.gguf_writer import Q, make_tiny_gguf


def random_linear(out: int = 96, inp: int = 64, bias: bool = False, seed: int = 0) -> tuple[Int8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=g) * inp ** -0.5
    return Int8Linear.of(weight, torch.randn(out, generator=g) if bias else None), weight


def test_weights_round_to_their_rows_scale():
    weight = torch.randn(8, 32) * torch.arange(1, 9)[:, None]
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and q.abs().max() == WEIGHT_MAX
    torch.testing.assert_close(scale, weight.abs().amax(1) / WEIGHT_MAX)
    assert ((q * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_a_row_gives_the_same_bits_in_any_batch():
    lin, _ = random_linear(bias=True)
    x = torch.randn(40, 64) * torch.rand(40, 1) * 10
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    for start, size in [(0, 2), (3, 5), (0, 8), (7, 9), (0, 17), (1, 33), (0, 40)]:
        assert torch.equal(lin(x[start:start + size]), alone[start:start + size])


@pytest.mark.parametrize("form", ["plain", "normed", "glu"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_what_the_reference_computes(form, bias):
    """The same bits where no norm or gating is involved (exact integer sums, the same float epilogue); a width
    of 100 pads to 128 and leaves a tail past the 8-lane blocks; 13 rows and 7 channels leave partial tiles."""
    assert native.register()
    g = torch.Generator().manual_seed(1)
    lin, _ = random_linear(out=7, inp=100, bias=bias)
    x = torch.randn(13, 2 * 100 if form == "glu" else 100, generator=g) * 4
    x[2] = 0
    x[5, 0] = 90.0                                                              # e^-90 underflows in the sigmoid
    norm = torch.rand(100, generator=g) + 0.5 if form == "normed" else None
    args = (norm, 1e-5, form == "glu", lin.weight, lin.scale, lin.bias)
    got = torch.ops.specserve.int8_linear(x, *args)
    want = reference(x, *args)
    if form == "plain":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)   # an activation may round to its neighbour
    assert torch.equal(got[2], torch.zeros(7) if lin.bias is None else lin.bias)


@pytest.mark.parametrize("form", ["plain", "glu"])
def test_a_residual_is_added_to_the_result_as_torch_adds_it(form):
    """The layer's residual stream added in the kernel: the same bits as the unfused `residual + linear(x)`, in
    the kernel and in its reference, for the float linear too."""
    native.register()
    lin, weight = random_linear(out=7, inp=100, bias=True)
    x = torch.randn(5, 2 * 100 if form == "glu" else 100) * 3
    residual = torch.randn(5, 7) * 10
    for linear in (lin, Linear(weight, lin.bias)):
        call = linear.glu if form == "glu" else linear.forward
        assert torch.equal(call(x, residual), residual + call(x))
    args = (None, 0.0, form == "glu", lin.weight, lin.scale, lin.bias)
    if form == "plain":
        assert torch.equal(reference(x, *args, residual), residual + reference(x, *args))
        assert torch.equal(torch.ops.specserve.int8_linear(x, *args, residual), reference(x, *args, residual))


def test_fused_norm_and_gating_give_a_row_the_same_bits_in_any_batch():
    lin, _ = random_linear(bias=True)
    down, _ = random_linear(out=32, seed=1)
    norm = torch.rand(64) + 0.5
    x, gate_up = torch.randn(20, 64) * 5, torch.randn(20, 128) * 3
    for fused in (lambda rows: lin.normed(x[rows], norm, 1e-6), lambda rows: down.glu(gate_up[rows])):
        alone = torch.cat([fused(slice(i, i + 1)) for i in range(20)])
        for start, size in [(0, 3), (2, 9), (0, 20), (5, 15)]:
            assert torch.equal(fused(slice(start, start + size)), alone[start:start + size])


def test_fused_forms_match_the_float_linear_forms():
    weight, norm = torch.randn(48, 64) / 8, torch.rand(64) + 0.5
    x, gate_up = torch.randn(4, 64), torch.randn(4, 128)
    int8, fp32 = Int8Linear.of(weight), Linear(weight)
    assert (int8.normed(x, norm, 1e-6) - fp32.normed(x, norm, 1e-6)).norm() / fp32.normed(x, norm, 1e-6).norm() < 0.03
    wide_weight = torch.randn(48, 64) / 8
    int8_wide, fp32_wide = Int8Linear.of(wide_weight), Linear(wide_weight)
    want = fp32_wide.glu(gate_up)
    assert (int8_wide.glu(gate_up) - want).norm() / want.norm() < 0.03


@pytest.mark.parametrize("out, inp", [(7, 100), (16, 64), (40, 300)])
def test_both_weight_layouts_hold_the_weights_and_give_the_same_bits(out, inp):
    """Blocks of 4 channels x 32 inputs (AVX2) and of 16 channels x 4 inputs (AVX-512 VNNI) unpack to the same
    weights and compute the same bits: 11 rows leave partial tiles of 8 and 2; channels that are not a multiple of
    16 leave masked lanes. The kernel's VNNI path runs where the CPU has it; the reference reads either layout."""
    g = torch.Generator().manual_seed(3)
    q, scale = quantize_rows(torch.randn(out, inp, generator=g))
    bias, x = torch.randn(out, generator=g), torch.randn(11, inp, generator=g) * 3
    residual = torch.randn(11, out, generator=g)
    four, sixteen = pack(q), pack(q, vnni=True)
    assert four.shape[2:] == (4, 32) and sixteen.shape[2:] == (16, 4)
    assert torch.equal(unpack(four, out, inp), q) and torch.equal(unpack(sixteen, out, inp), q)
    want = torch.ops.specserve.int8_linear(x, None, 0.0, False, four, scale, bias, residual)
    assert torch.equal(reference(x, None, 0.0, False, sixteen, scale, bias, residual), want)
    if native.vnni():
        got = torch.ops.specserve.int8_linear(x, None, 0.0, False, sixteen, scale, bias, residual)
        assert torch.equal(got, want)
        assert torch.equal(torch.ops.specserve.int8_linear(x[4:5], None, 0.0, False, sixteen, scale, bias,
                                                           residual[4:5]), want[4:5])


def test_rows_at_the_extremes_do_not_saturate():
    """All-maximal activations against all-maximal weights: the pairwise int16 sums of non-VNNI x86 kernels
    would saturate with 8-bit weights."""
    weight = torch.ones(64, 576)
    weight[1::2] = -1
    y = Int8Linear.of(weight)(torch.ones(2, 576))
    torch.testing.assert_close(y[:, :2], torch.tensor([[576.0, -576.0]] * 2), rtol=0.01, atol=0)


def test_close_to_the_float_product_and_zero_rows_stay_zero():
    lin, weight = random_linear(out=256, inp=128, bias=True)
    x = torch.randn(16, 128, dtype=torch.float64)
    x[3] = 0
    y = lin(x)
    exact = x @ weight.double().T + lin.bias
    assert y.dtype == torch.float64 and torch.isfinite(y).all()
    torch.testing.assert_close(y[3], lin.bias.double())
    assert (y - exact).norm() / exact.norm() < 0.03


def test_rows_of_a_linear_are_its_output_columns():
    lin, _ = random_linear(bias=True)
    x = torch.randn(3, 64)
    index = torch.tensor([5, 0, 17, 95])
    assert torch.equal(lin.rows(index)(x), lin(x)[:, index])


def test_an_int8_model_stays_close_to_float(tiny_llama):
    ids, positions = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), torch.arange(8)
    logits = {}
    for quantization in ("none", "int8"):
        model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float64, quantization=quantization)
        assert isinstance(model.layers[0].qkv, Int8Linear) == (quantization == "int8")
        assert isinstance(model.head, Int8Linear) == (quantization == "int8")
        pool = KVPool(KVGeometry.of(model.config, torch.float64), 2, 4)
        meta = AttentionMetadata.build([SeqSpan([0, 1], 0, 8)], 4, pool.null_slot)
        logits[quantization] = model.logits(model.forward(ids, positions, meta, pool)[0])
    cosine = torch.nn.functional.cosine_similarity(logits["none"], logits["int8"], dim=-1)
    assert (cosine > 0.99).all() and not torch.equal(logits["none"], logits["int8"])


@pytest.mark.parametrize("qtype, default", [(Q.Q8_0, "int8"), (Q.F32, "none")])
def test_quantized_weights_default_to_int8_and_the_flag_overrides(tmp_path, monkeypatch, caplog, qtype, default):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    make_tiny_gguf(path, qtype=qtype)
    for _ in range(2):                       # a cold conversion, then the cache: both know the source
        with caplog.at_level(logging.INFO, logger="specserve.engine"):
            llm = LLM(str(path), num_pages=8, page_size=4)
        assert llm.engine.model.quantization == default
        assert f"quantization: {default} (the default for" in caplog.text
        caplog.clear()
    other = "none" if default == "int8" else "int8"
    assert LLM(str(path), num_pages=8, page_size=4, quantization=other).engine.model.quantization == other
    with pytest.raises(ValueError, match="--quantization must be one of none, int8, got 'int4'"):
        LLM(str(path), num_pages=8, page_size=4, quantization="int4")
