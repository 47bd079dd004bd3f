// DSPARK's greedy drafts through its Markov head in one op: row k of a block drafts argmax(base_k + W2 W1[prev_k]),
// where prev_k is the draft of row k - 1 (the anchor's for row 0), so the rows run in turn. As a Python loop each
// row was three dispatched ops and a pass of the interpreter, ~45 µs against ~12 for its arithmetic (SmolLM2's 8,192
// draft tokens, rank 64); here a row calls the same int8 linear and argmax kernels directly, so the same bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels.h"

#include <tuple>

// base: [jobs, rows, V] float32 logits before the Markov term; prev: [jobs] int64 draft ids (V: a token outside the
// draft vocabulary); w1: [V + 1, r] float32 (its last row zero); w2, w2_scale: the int8 linear r → V
// → [jobs, rows] int64 draft ids
at::Tensor markov_greedy(const at::Tensor& base, const at::Tensor& prev_in, const at::Tensor& w1,
                         const at::Tensor& w2, const at::Tensor& w2_scale) {
  TORCH_CHECK(base.scalar_type() == at::kFloat && base.dim() == 3, "markov_greedy: base must be float32 [jobs, rows, V]");
  TORCH_CHECK(prev_in.scalar_type() == at::kLong && prev_in.dim() == 1 && prev_in.size(0) == base.size(0),
              "markov_greedy: prev must be int64 [jobs]");
  TORCH_CHECK(w1.scalar_type() == at::kFloat && w1.dim() == 2 && w1.size(0) == base.size(2) + 1,
              "markov_greedy: w1 must be float32 [V + 1, rank]");
  const int64_t rows = base.size(1);
  at::Tensor out = at::empty({base.size(0), rows}, prev_in.options());
  at::Tensor prev = prev_in;
  for (int64_t k = 0; k < rows; ++k) {
    const at::Tensor scores = int8_linear(w1.index_select(0, prev), std::nullopt, 0.0, false, w2, w2_scale,
                                          std::nullopt, base.select(1, k));
    prev = argmax_rows(scores);
    out.select(1, k).copy_(prev);
  }
  return out;
}

// A DSPARK block's greedy heads in one op: the draft head over its rows, markov_greedy's chain, and each row's
// confidence sigmoid(Linear([h_k; W1[prev_k]]) / T_k), prev_k being the pick before row k (the anchor's for row 0).
// As torch ops from Python these were ~12 dispatched ops after the block forward, ~0.3 ms of a batch-1 step that met
// each op's code and data cold; here the same kernels, so the same picks. hidden: [jobs, rows, H] float32
// final-normed block rows; head, head_scale: the int8 head H → V; prev, w1, w2, w2_scale: as markov_greedy's;
// confidence, confidence_scale, confidence_bias: the int8 head H + r → 1; temperatures: [>= rows] float32
// → the picks [jobs, rows] int64 draft ids and their confidences [jobs, rows] float32
std::tuple<at::Tensor, at::Tensor> dspark_greedy(const at::Tensor& hidden, const at::Tensor& prev,
                                                 const at::Tensor& head, const at::Tensor& head_scale,
                                                 const at::Tensor& w1, const at::Tensor& w2,
                                                 const at::Tensor& w2_scale, const at::Tensor& confidence,
                                                 const at::Tensor& confidence_scale,
                                                 const at::Tensor& confidence_bias, const at::Tensor& temperatures) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 3 && hidden.size(1) >= 1,
              "dspark_greedy: hidden must be float32 [jobs, rows >= 1, hidden]");
  const int64_t jobs = hidden.size(0), rows = hidden.size(1), width = hidden.size(2);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.numel() >= rows,
              "dspark_greedy: one float32 temperature per row");
  const at::Tensor flat = hidden.reshape({jobs * rows, width});
  const at::Tensor base = int8_linear(flat, std::nullopt, 0.0, false, head, head_scale, std::nullopt, std::nullopt);
  const at::Tensor picked = markov_greedy(base.view({jobs, rows, -1}), prev, w1, w2, w2_scale);
  const at::Tensor before = at::cat({prev.view({jobs, 1}), picked.narrow(1, 0, rows - 1)}, 1);   // [jobs, rows]
  const at::Tensor features = at::cat({flat, w1.index_select(0, before.flatten())}, 1);
  const at::Tensor logits = int8_linear(features, std::nullopt, 0.0, false, confidence, confidence_scale,
                                        confidence_bias, std::nullopt);
  return {picked, at::sigmoid(logits.view({jobs, rows}) / temperatures.narrow(0, 0, rows))};
}

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("markov_greedy(Tensor base, Tensor prev, Tensor w1, Tensor w2, Tensor w2_scale) -> Tensor");
  m.impl("markov_greedy", c10::DispatchKey::CPU, &markov_greedy);
  m.def("dspark_greedy(Tensor hidden, Tensor prev, Tensor head, Tensor head_scale, Tensor w1, Tensor w2, "
        "Tensor w2_scale, Tensor confidence, Tensor confidence_scale, Tensor confidence_bias, Tensor temperatures) "
        "-> (Tensor, Tensor)");
  m.impl("dspark_greedy", c10::DispatchKey::CPU, &dspark_greedy);
}
