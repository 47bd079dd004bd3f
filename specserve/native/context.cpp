// A block drafter's context write in one op (models/block_drafter.py, BlockDrafter.write_context with context_norm
// and an int8 fc): each target layer's stream RMS-normalised, fc, the hidden norm → the context vectors, then per
// draft layer its K/V projection, rotary on K and the write into that layer's pools. As ~25 small torch ops it cost
// ~0.5 ms of a batch-1 DSPARK step for one or two tokens (0.15 ms when run twice in a row): the target's weights had
// just streamed through the caches, and each dispatched op met its own code and data cold.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"

#include <vector>

// aux: [n, target_layers * target_hidden] float32 residual streams of committed tokens; fc, fc_scale: the int8 fc;
// hidden_norm: [hidden]; kv, kv_scale: per draft layer the int8 K/V projection (K heads then V heads); cos_table,
// sin_table: [max_positions, head_dim]; positions, slots: [n] int64; k_pool, v_pool: [layers, slots, kv_heads,
// head_width] → the context vectors [n, hidden]
at::Tensor draft_context(const at::Tensor& aux_in, int64_t target_layers, double eps, const at::Tensor& fc,
                         const at::Tensor& fc_scale, const at::Tensor& hidden_norm, const std::vector<at::Tensor>& kv,
                         const std::vector<at::Tensor>& kv_scale, const at::Tensor& cos_table,
                         const at::Tensor& sin_table, const at::Tensor& positions, at::Tensor& k_pool,
                         at::Tensor& v_pool, const at::Tensor& slots) {
  const at::Tensor aux = aux_in.contiguous();
  TORCH_CHECK(aux.scalar_type() == at::kFloat && aux.dim() == 2 && target_layers > 0 &&
                  aux.size(1) % target_layers == 0,
              "draft_context: aux must be float32 [n, target_layers * target_hidden]");
  TORCH_CHECK(kv.size() == kv_scale.size() && static_cast<int64_t>(kv.size()) == k_pool.size(0) &&
                  k_pool.size(0) == v_pool.size(0),
              "draft_context: one K/V projection per pool layer");
  TORCH_CHECK(positions.numel() == aux.size(0) && slots.numel() == aux.size(0),
              "draft_context: one position and one slot per row");
  const int64_t n = aux.size(0), width = aux.size(1) / target_layers;
  const float e = static_cast<float>(eps);
  // the target layers' norms have no weight: times 1, exact
  const std::vector<float> ones(width, 1.0f);
  at::Tensor normed_aux = at::empty_like(aux);
  at::parallel_for(0, n * target_layers, 64, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      specserve::normed(aux.data_ptr<float>() + u * width, width, ones.data(), e,
                        normed_aux.data_ptr<float>() + u * width);
  });
  const at::Tensor projected = int8_linear(normed_aux, std::nullopt, 0.0, false, fc, fc_scale, std::nullopt, std::nullopt);
  const int64_t hidden = projected.size(1);
  TORCH_CHECK(hidden_norm.scalar_type() == at::kFloat && hidden_norm.numel() == hidden,
              "draft_context: hidden_norm must be float32 [hidden]");
  at::Tensor context = at::empty_like(projected);
  for (int64_t r = 0; r < n; ++r)
    specserve::normed(projected.data_ptr<float>() + r * hidden, hidden, hidden_norm.data_ptr<float>(), e,
                      context.data_ptr<float>() + r * hidden);
  const at::Tensor cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);
  for (size_t i = 0; i < kv.size(); ++i) {
    const at::Tensor rows = int8_linear(context, std::nullopt, 0.0, false, kv[i], kv_scale[i], std::nullopt,
                                        std::nullopt);
    at::Tensor k = k_pool.select(0, static_cast<int64_t>(i)), v = v_pool.select(0, static_cast<int64_t>(i));
    write_kv(rows, cos, sin, k, v, slots);
  }
  return context;
}

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("draft_context(Tensor aux, int target_layers, float eps, Tensor fc, Tensor fc_scale, Tensor hidden_norm, "
        "Tensor[] kv, Tensor[] kv_scale, Tensor cos_table, Tensor sin_table, Tensor positions, Tensor(a!) k_pool, "
        "Tensor(b!) v_pool, Tensor slots) -> Tensor");
  m.impl("draft_context", c10::DispatchKey::CPU, &draft_context);
}
