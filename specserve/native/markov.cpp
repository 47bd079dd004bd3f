// DSPARK's greedy drafts through its Markov head in one op: row k of a block drafts argmax(base_k + W2 W1[prev_k]),
// where prev_k is the draft of row k - 1 (the anchor's for row 0), so the rows run in turn. As a Python loop each
// row was three dispatched ops and a pass of the interpreter, ~45 µs against ~12 for its arithmetic (SmolLM2's 8,192
// draft tokens, rank 64); here a row calls the same int8 linear and argmax kernels directly, so the same bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels.h"

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

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("markov_greedy(Tensor base, Tensor prev, Tensor w1, Tensor w2, Tensor w2_scale) -> Tensor");
  m.impl("markov_greedy", c10::DispatchKey::CPU, &markov_greedy);
}
