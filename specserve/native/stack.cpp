// A decoder stack's forward in one call, for the layers whose every op is one of ours: int8 linears over float32
// rows and the row-invariant attention (no qk-norm). Per layer it runs exactly the ops the scripted stack runs, in
// the same order and on the same values (so the same bits), but calls the kernels directly: at batch 1 the
// TorchScript interpreter and the dispatcher around a layer's five ops cost a tenth of a SmolLM2 step.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

namespace {

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct DecoderStack : torch::CustomClassHolder {
  // per layer: the input norm [hidden], the fused QKV int8 weight and its scale (and bias: an empty tensor for
  // none), the output projection, the post-attention norm, the fused gate/up projection and the down projection
  std::vector<at::Tensor> input_norm, qkv, qkv_scale, qkv_bias, o, o_scale, post_norm, gate_up, gate_up_scale, down,
      down_scale;
  int64_t heads;
  double scale, eps;

  DecoderStack(std::vector<at::Tensor> input_norm, std::vector<at::Tensor> qkv, std::vector<at::Tensor> qkv_scale,
               std::vector<at::Tensor> qkv_bias, std::vector<at::Tensor> o, std::vector<at::Tensor> o_scale,
               std::vector<at::Tensor> post_norm, std::vector<at::Tensor> gate_up,
               std::vector<at::Tensor> gate_up_scale, std::vector<at::Tensor> down, std::vector<at::Tensor> down_scale,
               int64_t heads, double scale, double eps)
      : input_norm(std::move(input_norm)), qkv(std::move(qkv)), qkv_scale(std::move(qkv_scale)),
        qkv_bias(std::move(qkv_bias)), o(std::move(o)), o_scale(std::move(o_scale)), post_norm(std::move(post_norm)),
        gate_up(std::move(gate_up)), gate_up_scale(std::move(gate_up_scale)), down(std::move(down)),
        down_scale(std::move(down_scale)), heads(heads), scale(scale), eps(eps) {
    const size_t n = this->input_norm.size();
    for (const auto* part : {&this->qkv, &this->qkv_scale, &this->qkv_bias, &this->o, &this->o_scale,
                             &this->post_norm, &this->gate_up, &this->gate_up_scale, &this->down, &this->down_scale})
      TORCH_CHECK(part->size() == n, "DecoderStack: every weight list needs one entry per layer (", n, ")");
  }

  // x: [rows, hidden] float32; cos, sin: [rows, head_dim]; k_pool, v_pool: [layers, slots, kv_heads, head_dim(+4)];
  // the rest as paged_attention_qkv's → the residual stream after the last layer, and after each aux layer
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                                          at::Tensor k_pool, at::Tensor v_pool,
                                                          at::Tensor slot_mapping, at::Tensor row_seq,
                                                          at::Tensor row_len, at::Tensor seq_slots,
                                                          std::vector<int64_t> aux_layer_ids) {
    const int64_t layers = static_cast<int64_t>(input_norm.size());
    TORCH_CHECK(k_pool.size(0) == layers && v_pool.size(0) == layers,
                "DecoderStack: the K/V pools hold ", k_pool.size(0), " layers, the stack ", layers);
    std::vector<at::Tensor> aux;
    for (int64_t i = 0; i < layers; ++i) {
      const at::Tensor h = int8_linear(x, input_norm[i], eps, false, qkv[i], qkv_scale[i], present(qkv_bias[i]),
                                       std::nullopt);
      at::Tensor k = k_pool.select(0, i), v = v_pool.select(0, i);
      const at::Tensor attended = paged_attention_qkv(h, cos, sin, k, v, slot_mapping, row_seq, row_len, seq_slots,
                                                      heads, scale);
      x = int8_linear(attended, std::nullopt, 0.0, false, o[i], o_scale[i], std::nullopt, x);
      const at::Tensor gated = int8_linear(x, post_norm[i], eps, false, gate_up[i], gate_up_scale[i], std::nullopt,
                                           std::nullopt);
      x = int8_linear(gated, std::nullopt, 0.0, true, down[i], down_scale[i], std::nullopt, x);
      if (std::find(aux_layer_ids.begin(), aux_layer_ids.end(), i) != aux_layer_ids.end()) aux.push_back(x);
    }
    return {x, aux};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, double, double>())
      .def("forward", &DecoderStack::forward);
}
