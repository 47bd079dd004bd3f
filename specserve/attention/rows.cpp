// Paged attention computed row by row in float32, the same way for every query row: a row's result depends only
// on its query, its keys and values and how many there are, never on the other rows of the batch, the verify
// window or the prefill chunk beside it. Speculation then reproduces plain decoding bit for bit without float64.
//
// Each (row, KV head) pair reads its keys in place from the pool through its sequence's slot table, in splits of
// SPLIT keys (fixed by key index, so a row's splits are the same in any step); the splits run in parallel (two
// threads share a 4k-token decode) and are merged in split order. Within a split the scores, exponentials, sums
// and value products follow one fixed order of AVX2 operations. The pool holds float32 or float16 K/V (widened
// exactly to float32 as it is read: half the bytes to stream at long contexts).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t SPLIT = 512;

// e^x for 8 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial); inputs <= 0 here.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

struct Work {
  int64_t row, kv_head, split;
};

}  // namespace

// q: [rows, heads, head_dim]; k_pool, v_pool: [slots, kv_heads, head_dim]; row_seq, row_len: [rows] (the row's
// sequence, and how many of its keys it attends: keys 0 .. row_len - 1 of that sequence's slots);
// seq_slots: [sequences, max_keys] → [rows, heads, head_dim]
template <typename KV>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& row_seq,
                  const at::Tensor& row_len, const at::Tensor& seq_slots, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && seq_slots.is_contiguous(),
              "paged_attention_rows takes contiguous tensors");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(d % 8 == 0 && heads % kv_heads == 0, "head_dim must be a multiple of 8");
  const int64_t group = heads / kv_heads, max_keys = seq_slots.size(1);
  const float fscale = static_cast<float>(scale);
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* len = row_len.data_ptr<int64_t>();
  const int64_t* slots = seq_slots.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const KV* kp = static_cast<const KV*>(k_pool.data_ptr());
  const KV* vp = static_cast<const KV*>(v_pool.data_ptr());

  std::vector<Work> work;
  std::vector<int64_t> first(rows + 1, 0);      // work items of row r: first[r] .. first[r + 1], kv head major
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= max_keys, "row_len out of range");
    const int64_t splits = (len[r] + SPLIT - 1) / SPLIT;
    first[r] = static_cast<int64_t>(work.size());
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t s = 0; s < splits; ++s) work.push_back({r, g, s});
  }
  first[rows] = static_cast<int64_t>(work.size());
  const int64_t items = first[rows];
  // per work item and head of its group: the split's max score, sum of exponentials and weighted values
  std::vector<float> part_max(items * group), part_sum(items * group), part_acc(items * group * d);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * SPLIT);
    std::vector<const KV*> keys(SPLIT + 8), values(SPLIT);
    for (int64_t w = begin; w < end; ++w) {
      const Work& it = work[w];
      const int64_t lo = it.split * SPLIT, hi = std::min(len[it.row], lo + SPLIT), n = hi - lo;
      const int64_t* row_slots = slots + seq[it.row] * max_keys + lo;
      for (int64_t j = 0; j < n; ++j) {
        keys[j] = kp + (row_slots[j] * kv_heads + it.kv_head) * d;
        values[j] = vp + (row_slots[j] * kv_heads + it.kv_head) * d;
      }
      for (int64_t j = n; j < n + 8; ++j) keys[j] = keys[0];     // padding lanes of the last 8 keys
      const float* qrow = qp + (it.row * heads + it.kv_head * group) * d;
      for (int64_t h = 0; h < group; ++h) {
        // Scores 8 keys at a time, each its own chain of FMAs over head_dim: the same operations for a key
        // wherever it falls, only more of them in flight.
        const float* qh = qrow + h * d;
        float* p = scores.data() + h * SPLIT;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
          __m256 acc[8];
          for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
          for (int64_t i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + i);
            for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, load8(keys[j0 + k] + i), acc[k]);
          }
          const int64_t m = std::min<int64_t>(8, n - j0);
          for (int64_t k = 0; k < m; ++k) {
            p[j0 + k] = sum8(acc[k]) * fscale;
            top = std::max(top, p[j0 + k]);
          }
        }
        const __m256 mv = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
          _mm256_storeu_ps(p + j, e);
          total = _mm256_add_ps(total, e);
        }
        float tail = 0.0f;
        if (j < n) {
          alignas(32) float buf[8] = {0};
          for (int64_t t = j; t < n; ++t) buf[t - j] = p[t] - top;
          alignas(32) float e[8];
          _mm256_store_ps(e, exp8(_mm256_load_ps(buf)));
          for (int64_t t = j; t < n; ++t) {
            p[t] = e[t - j];
            tail += e[t - j];
          }
        }
        part_max[w * group + h] = top;
        part_sum[w * group + h] = sum8(total) + tail;
        // Weighted values, 32 output lanes at a time in registers, keys in order.
        float* acc = part_acc.data() + (w * group + h) * d;
        int64_t i0 = 0;
        for (; i0 + 32 <= d; i0 += 32) {
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t jj = 0; jj < n; ++jj) {
            const __m256 pj = _mm256_set1_ps(p[jj]);
            const KV* v = values[jj] + i0;
            a0 = _mm256_fmadd_ps(pj, load8(v), a0);
            a1 = _mm256_fmadd_ps(pj, load8(v + 8), a1);
            a2 = _mm256_fmadd_ps(pj, load8(v + 16), a2);
            a3 = _mm256_fmadd_ps(pj, load8(v + 24), a3);
          }
          _mm256_storeu_ps(acc + i0, a0);
          _mm256_storeu_ps(acc + i0 + 8, a1);
          _mm256_storeu_ps(acc + i0 + 16, a2);
          _mm256_storeu_ps(acc + i0 + 24, a3);
        }
        for (; i0 < d; i0 += 8) {
          __m256 a0 = _mm256_setzero_ps();
          for (int64_t jj = 0; jj < n; ++jj) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[jj]), load8(values[jj] + i0), a0);
          _mm256_storeu_ps(acc + i0, a0);
        }
      }
    }
  });

  at::Tensor out = at::empty({rows, heads, d}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u / kv_heads, g = u % kv_heads;
      const int64_t splits = (first[r + 1] - first[r]) / kv_heads;
      const int64_t w0 = first[r] + g * splits;
      for (int64_t h = 0; h < group; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits; ++s) m = std::max(m, part_max[(w0 + s) * group + h]);
        float total = 0.0f;
        float* o = op + (r * heads + g * group + h) * d;
        std::fill(o, o + d, 0.0f);
        for (int64_t s = 0; s < splits; ++s) {
          const float f = std::exp(part_max[(w0 + s) * group + h] - m);
          total += f * part_sum[(w0 + s) * group + h];
          const float* a = part_acc.data() + ((w0 + s) * group + h) * d;
          for (int64_t i = 0; i < d; ++i) o[i] += f * a[i];
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < d; ++i) o[i] *= inv;
      }
    }
  });
  return out;
}

at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& row_seq, const at::Tensor& row_len, const at::Tensor& seq_slots,
                                double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention_rows takes float32 queries");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools must share a dtype");
  if (k_pool.scalar_type() == at::kFloat) return attend<float>(q, k_pool, v_pool, row_seq, row_len, seq_slots, scale);
  TORCH_CHECK(k_pool.scalar_type() == at::kHalf, "paged_attention_rows takes float32 or float16 pools");
  return attend<uint16_t>(q, k_pool, v_pool, row_seq, row_len, seq_slots, scale);
}

TORCH_LIBRARY(specserve, m) {
  m.def("paged_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor row_seq, Tensor row_len, "
        "Tensor seq_slots, float scale) -> Tensor");
  m.impl("paged_attention_rows", c10::DispatchKey::CPU, &paged_attention_rows);
}
