// The kernels one op composes from another translation unit (stack.cpp, markov.cpp and context.cpp call them without
// the dispatcher).
#pragma once

#include <ATen/ATen.h>

#include <optional>

at::Tensor int8_linear(const at::Tensor& x_in, const std::optional<at::Tensor>& norm_weight, double eps, bool glu,
                       const at::Tensor& weight, const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual_in);

at::Tensor paged_attention_qkv(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                               at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
                               const at::Tensor& row_seq, const at::Tensor& row_len, const at::Tensor& seq_slots,
                               int64_t heads, double scale);

void write_kv(const at::Tensor& kv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool,
              const at::Tensor& slot_mapping);

at::Tensor argmax_rows(const at::Tensor& x_in);
