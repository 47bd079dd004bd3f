// Paged attention computed row by row in float32, the same way for every query row: a row's result depends only
// on its query, its keys and values and how many there are, never on the other rows of the batch, the verify
// window or the prefill chunk beside it. Speculation then reproduces plain decoding bit for bit without float64.
//
// Each row reads its keys in place from the pool through its sequence's slot table, in splits of SPLIT keys (fixed
// by key index, so a row's splits are the same in any step); the splits run in parallel (two threads share a
// 4k-token decode) and are merged in split order. Consecutive rows of one sequence (a verify window, a prefill
// chunk) share the work on a split, up to ROW_GROUP of them: each key is widened once for all of them. For each row
// the scores, exponentials, sums and value products follow one fixed order of operations. Two paths, chosen by the
// CPU once: AVX-512 (head_dim 64 or 128) scores 16 keys at a time with the split's K and V lines requested ahead,
// and weighs the values of several query heads of a KV head at once; AVX2 (elsewhere) first streams the split's K
// and V into cache, then scores 8 keys at a time and weighs head by head. The pool holds float32 or float16 K/V
// (widened exactly to float32 as it is read: half the bytes to stream at long contexts), or int8 K/V with one
// float32 scale per slot and KV head, stored after the head's values (a quarter of float32's bytes plus the scale):
// each value is read as int8 x scale (a key's scale applied to its score), one rounding, the same wherever read. An
// int8 pool's queries are rounded to int8 too, in blocks of 16 values with a scale each, so that on a CPU with
// AVX-512 VNNI a score is exact integer dot products (vpdpbusd over the 16 keys' bytes transposed) times the scales.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

using namespace specserve;

namespace {

constexpr int64_t SPLIT = 512;
constexpr int64_t ROW_GROUP = 16;    // rows of one sequence that share a pass over a split's keys

// Elements after a KV head's head_dim values in a slot: an int8 pool's float32 scale (4 bytes), none otherwise.
template <typename KV>
constexpr int64_t SCALE_ELEMS = std::is_same_v<KV, int8_t> ? 4 : 0;

// The scale of the KV head whose values start at `head` (1 unless the pool is int8).
template <typename KV>
inline float head_scale(const KV* head, int64_t d) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    float scale;
    std::memcpy(&scale, head + d, sizeof scale);
    return scale;
  } else {
    return 1.0f;
  }
}

// Reads every cache line of the n slots' K and V once, in slot order, and returns a value made of them (so that the
// reads stay). The pool's lines then arrive at the memory's streaming speed, ahead of the passes that use them
// head by head: those passes, reading straight from memory, ran at a quarter of it at a 4k-token context.
template <typename KV>
int32_t touch(const KV* const* key_slots, const KV* const* value_slots, int64_t n, int64_t slot_size) {
  int32_t seen = 0;
  const int64_t bytes = slot_size * static_cast<int64_t>(sizeof(KV));
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* k = reinterpret_cast<const int8_t*>(key_slots[j]);
    const int8_t* v = reinterpret_cast<const int8_t*>(value_slots[j]);
    for (int64_t b = 0; b < bytes; b += 64) seen |= k[b] | v[b];
  }
  return seen;
}

// out[j, :] = the d values of the KV head at slots[j] + offset as float32 (an int8 pool's without its scale), j < n.
template <typename KV>
void widen(const KV* const* slots, int64_t n, int64_t offset, int64_t d, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const KV* src = slots[j] + offset;
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(out + j * d + i, load8(src + i));
  }
}

// acc[0 .. 8 * V) = sum over keys j < n, in order, of p[j] * the values of the KV head at values[j] + head from its
// value `lane` on (an int8 pool's p[j] first times the head's scale): V independent chains of FMAs.
template <int V, typename KV>
inline void weigh(const float* p, int64_t n, const KV* const* values, int64_t head, int64_t lane, int64_t d,
                  float* acc) {
  __m256 a[V];
  for (int k = 0; k < V; ++k) a[k] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const KV* h = values[j] + head;
    const __m256 pj = _mm256_set1_ps(p[j] * head_scale(h, d));
    for (int k = 0; k < V; ++k) a[k] = _mm256_fmadd_ps(pj, load8(h + lane + 8 * k), a[k]);
  }
  for (int k = 0; k < V; ++k) _mm256_storeu_ps(acc + 8 * k, a[k]);
}

// The dot products of query q with 8 float32 keys `stride` apart: each its own chain of FMAs over head_dim d, then
// one transposing sum of the 8.
inline __m256 dot8(const float* q, const float* keys, int64_t stride, int64_t d) {
  __m256 acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + k * stride + i), acc[k]);
  }
  return sum8x8(acc);
}

// x's d values rounded (half to even) to the nearest of 255 levels over their largest magnitude, into dst; returns
// the scale, peak / 127 (0 for an all-zero head).
inline float quantize_head(const float* x, int64_t d, int8_t* dst) {
  float peak = 0.0f;
  for (int64_t i = 0; i < d; ++i) peak = std::max(peak, std::fabs(x[i]));
  const float inv = peak > 1e-30f ? 127.0f / peak : 0.0f;
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f));
  return peak > 1e-30f ? peak / 127.0f : 0.0f;
}

// An int8 pool's query values per scale: 16 (8 where head_dim is not a multiple of 16).
constexpr int64_t query_block(int64_t d) { return d % 16 == 0 ? 16 : 8; }

// An int8 pool's queries, each block of query_block values quantized as a key head is (quantize_head; one scale for
// a head's 64 values cost SmolLM2 +0.2% NLL against a float16 cache, blocks of 16 +0.07%). The other paths score
// the blocks' dequantized values in float32; the VNNI path each block's exact integer dot product times its scale.
struct Queries {
  std::vector<int8_t> values;          // [rows, heads, d]
  std::vector<float> dequantized;      // [rows, heads, d]: values x their block's scale
  std::vector<float> scale;            // [rows, heads, d / query_block(d)]
  std::vector<int32_t> sum;            // [rows, heads, d / query_block(d)]: each block's sum (dpbusd's offset / 128)

  Queries(const float* q, int64_t row_heads, int64_t d)
      : values(row_heads * d), dequantized(row_heads * d), scale(row_heads * d / query_block(d)),
        sum(row_heads * d / query_block(d), 0) {
    const int64_t block = query_block(d);
    for (int64_t b = 0; b < row_heads * d / block; ++b) {
      const int64_t at = b * block;
      scale[b] = quantize_head(q + at, block, values.data() + at);
      for (int64_t i = at; i < at + block; ++i) {
        dequantized[i] = values[i] * scale[b];
        sum[b] += values[i];
      }
    }
  }
};

// Whether 8 slots follow each other in the pool.
inline bool adjacent(const int64_t* slots) {
  for (int k = 1; k < 8; ++k)
    if (slots[k] != slots[0] + k) return false;
  return true;
}

// Rows row .. row + rows - 1 (consecutive rows of one sequence: a verify window, a prefill chunk) over one split.
struct Work {
  int64_t row, rows, split;
};

// What a work item reads and where it writes: the op's arguments, and per part (a row's split) and head the split's
// max score, sum of exponentials and weighted values.
template <typename KV>
struct Split {
  const float* q;                      // [rows, heads, d]; an int8 pool's: Queries::dequantized
  const int64_t* len;                  // row_len
  int64_t heads, kv_heads, group, d, head_width, slot_size, split_keys;
  float scale;
  const int64_t* first;                // a row's first part
  float *part_max, *part_sum, *part_acc;
  bool vnni;                           // an int8 pool's scores by AVX-512 VNNI
  const int8_t* query_int8;            // [rows, heads, d]: an int8 pool's quantized queries, else null
  const float* query_scale;            // [rows, heads, d / 16]: their scales (head_dim 64 or 128), else null
  const int32_t* query_sum;            // [rows, heads, d / 16]: their blocks' sums, else null

  // scores[(r - it.row) * heads + h][j] ← e^(score - the split's max) for the row's keys j < n; part_sum ← their sum
  void exponentiate(const Work& it, int64_t r, int64_t n, float* scores) const {
    const int64_t part = first[r] + it.split;
    for (int64_t h = 0; h < heads; ++h) {
      float* p = scores + ((r - it.row) * heads + h) * split_keys;
      const float top = part_max[part * heads + h];
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
      part_sum[part * heads + h] = sum8(total) + tail;
    }
  }

  // The AVX2 path: each KV head's 8 keys widened once for the group's rows and query heads, each score its own chain
  // of FMAs over head_dim, reduced by one transposing sum of 8 (the same operations for a key wherever it falls; a
  // row's lanes past its last key are computed but never used); then the values weighed head by head.
  void run_avx2(const Work& it, int64_t n_all, const int64_t* row_slots, const KV* const* key_slots,
                const KV* const* value_slots, float* scores, float* widened) const {
    const int64_t lo = it.split * SPLIT;
    __m256 ks = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n_all; j0 += 8) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const float* block = widened;      // the 8 keys of KV head g, float32, `stride` apart
        int64_t stride = d;
        if (std::is_same_v<KV, float> && j0 + 8 <= n_all && adjacent(row_slots + j0)) {
          block = reinterpret_cast<const float*>(key_slots[j0]) + g * d;     // read in place
          stride = slot_size;
        } else {
          widen(key_slots + j0, 8, g * head_width, d, widened);
        }
        if constexpr (std::is_same_v<KV, int8_t>) {
          alignas(32) float key_scale[8];
          for (int t = 0; t < 8; ++t) key_scale[t] = head_scale(key_slots[j0 + t] + g * head_width, d);
          ks = _mm256_mul_ps(_mm256_load_ps(key_scale), _mm256_set1_ps(scale));
        }
        for (int64_t r = it.row; r < it.row + it.rows; ++r) {
          const int64_t m = std::min<int64_t>(8, len[r] - lo - j0);
          if (m <= 0) continue;
          float* tops = part_max + (first[r] + it.split) * heads;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const __m256 s8 = _mm256_mul_ps(dot8(q + (r * heads + h) * d, block, stride, d), ks);
            float* p = scores + ((r - it.row) * heads + h) * split_keys + j0;
            if (m == 8) {
              _mm256_storeu_ps(p, s8);
              tops[h] = std::max(tops[h], max8(s8));
            } else {
              alignas(32) float buf[8];
              _mm256_store_ps(buf, s8);
              for (int64_t k = 0; k < m; ++k) {
                p[k] = buf[k];
                tops[h] = std::max(tops[h], buf[k]);
              }
            }
          }
        }
      }
    }
    for (int64_t r = it.row; r < it.row + it.rows; ++r) {
      const int64_t n = std::min(len[r] - lo, SPLIT), part = first[r] + it.split;
      if (n <= 0) continue;
      exponentiate(it, r, n, scores);
      // Weighted values, keys in order for each output lane; 64 lanes at a time in registers, so that eight
      // independent chains of FMAs hide their latency (four, with 32 lanes, could not).
      for (int64_t h = 0; h < heads; ++h) {
        const float* p = scores + ((r - it.row) * heads + h) * split_keys;
        const int64_t offset = (h / group) * head_width;
        float* acc = part_acc + (part * heads + h) * d;
        int64_t i0 = 0;
        for (; i0 + 64 <= d; i0 += 64) weigh<8>(p, n, value_slots, offset, i0, d, acc + i0);
        for (; i0 + 32 <= d; i0 += 32) weigh<4>(p, n, value_slots, offset, i0, d, acc + i0);
        for (; i0 < d; i0 += 8) weigh<1>(p, n, value_slots, offset, i0, d, acc + i0);
      }
    }
  }

  template <int DV>
  void run_avx512(const Work& it, int64_t n_all, const KV* const* key_slots, const KV* const* value_slots,
                  float* scores, float* widened) const;
  void keep16(const Work& it, int64_t r, int64_t h, int64_t j0, __m512 dots, __m512 ks, float* scores) const;
  template <int DV>
  void score16(const Work& it, int64_t j0, int64_t g, const float* widened, __m512 ks, float* scores) const;
  void score16_vnni(const Work& it, int64_t j0, int64_t g, const int8_t* const* keys, __m512 ks, float* scores,
                    int8_t* transposed) const;
};

#define SPECSERVE_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))

constexpr int64_t AHEAD = 64;   // keys ahead whose K and V lines are requested (into L2) while a key is scored

SPECSERVE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECSERVE_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SPECSERVE_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Requests every cache line of the `bytes` bytes from p.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
  _mm_prefetch(c + bytes - 1, _MM_HINT_T1);
}

// acc[h][0 .. 16 DV) = sum over keys j < n, in order, of p[h][j] (times the head's scale in an int8 pool) x the values
// of the KV head at values[j] + offset: NH query heads of one KV head at once, each key's values widened once.
template <int DV, int NH, typename KV>
SPECSERVE_AVX512 void weigh16(const float* const* p, int64_t n, const KV* const* values, int64_t offset, int64_t d,
                              float* const* acc) {
  __m512 a[NH][DV];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < DV; ++i) a[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const KV* v = values[j] + offset;
    const float vs = head_scale(v, d);
    __m512 x[DV];
    for (int i = 0; i < DV; ++i) x[i] = load16(v + 16 * i);
    for (int h = 0; h < NH; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h][j] * vs);
      for (int i = 0; i < DV; ++i) a[h][i] = _mm512_fmadd_ps(pj, x[i], a[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(acc[h] + 16 * i, a[h][i]);
}

// weigh16 for m <= NH heads
template <int DV, int NH, typename KV>
SPECSERVE_AVX512 void weigh_heads(int64_t m, const float* const* p, int64_t n, const KV* const* values,
                                  int64_t offset, int64_t d, float* const* acc) {
  if constexpr (NH > 1) {
    if (m < NH) return weigh_heads<DV, NH - 1>(m, p, n, values, offset, d, acc);
  }
  weigh16<DV, NH>(p, n, values, offset, d, acc);
}

// out lane t = the sum of v[t]'s 16 lanes, for 16 vectors at once; every lane's sum follows one tree (elements i and
// i + 2 of each 128-bit quarter, those two pairs, then the quarters 0 + 1 and 2 + 3, then the halves), so a key's
// score has the same bits in any lane.
SPECSERVE_AVX512 inline __m512 sum16x16(const __m512 v[16]) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xdd));
}

// Row r's head h against the 16 keys from j0: its dot products times each key's scale (the softmax's, times an int8
// key's) and an int8 query's scale, the same bits on every path; stored but for lanes past the row's last key, and
// the split's max raised.
template <typename KV>
SPECSERVE_AVX512 inline void Split<KV>::keep16(const Work& it, int64_t r, int64_t h, int64_t j0, __m512 dots,
                                               __m512 ks, float* scores) const {
  const int64_t m = std::min<int64_t>(16, len[r] - it.split * SPLIT - j0);
  const __m512 s = _mm512_mul_ps(dots, ks);
  const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
  _mm512_mask_storeu_ps(scores + ((r - it.row) * heads + h) * split_keys + j0, valid, s);
  float& top = part_max[(first[r] + it.split) * heads + h];
  top = std::max(top, _mm512_mask_reduce_max_ps(valid, s));
}

// The group's rows' scores for KV head g against the 16 keys from j0, widened to float32 in `widened`: each score one
// chain of DV FMAs, 16 of them summed by one transposing tree.
template <typename KV>
template <int DV>
SPECSERVE_AVX512 void Split<KV>::score16(const Work& it, int64_t j0, int64_t g, const float* widened, __m512 ks,
                                         float* scores) const {
  for (int64_t r = it.row; r < it.row + it.rows; ++r) {
    if (len[r] - it.split * SPLIT - j0 <= 0) continue;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const float* qh = q + (r * heads + h) * d;
      __m512 qv[DV], acc[16];
      for (int i = 0; i < DV; ++i) qv[i] = _mm512_loadu_ps(qh + 16 * i);
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(widened + t * DV * 16));
        for (int i = 1; i < DV; ++i) acc[t] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(widened + (t * DV + i) * 16), acc[t]);
      }
      keep16(it, r, h, j0, sum16x16(acc), ks, scores);
    }
  }
}

// The 16 keys' 64 bytes from `offset` as 16 vectors of their 32-bit words, k + 128 (dpbusd's unsigned operand):
// out[i] lane t = word i of key t.
SPECSERVE_VNNI inline void transpose16(const int8_t* const* keys, int64_t offset, __m512i out[16]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i a[16], b[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_xor_si512(_mm512_loadu_si512(keys[t] + offset), flip);
  for (int k = 0; k < 8; ++k) {        // b[2k] quarter L: words 4L, 4L + 1 of keys 2k, 2k + 1; b[2k + 1]: 4L + 2, 4L + 3
    b[2 * k] = _mm512_unpacklo_epi32(a[2 * k], a[2 * k + 1]);
    b[2 * k + 1] = _mm512_unpackhi_epi32(a[2 * k], a[2 * k + 1]);
  }
  for (int G = 0; G < 4; ++G) {        // a[4G + c] quarter L: word 4L + c of keys 4G .. 4G + 3
    a[4 * G] = _mm512_unpacklo_epi64(b[4 * G], b[4 * G + 2]);
    a[4 * G + 1] = _mm512_unpackhi_epi64(b[4 * G], b[4 * G + 2]);
    a[4 * G + 2] = _mm512_unpacklo_epi64(b[4 * G + 1], b[4 * G + 3]);
    a[4 * G + 3] = _mm512_unpackhi_epi64(b[4 * G + 1], b[4 * G + 3]);
  }
  for (int c = 0; c < 4; ++c) {        // out[4L + c] quarter G = a[4G + c] quarter L
    const __m512i x0 = _mm512_shuffle_i32x4(a[c], a[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(a[c], a[4 + c], 0xee);
    const __m512i x2 = _mm512_shuffle_i32x4(a[8 + c], a[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(a[8 + c], a[12 + c], 0xee);
    out[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xdd);
    out[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
  }
}

// score16 for an int8 pool by VNNI: the 16 keys' bytes transposed once into `transposed` (16 x head_dim bytes), then
// for each query block of 16 values one chain of 4 dpbusd against its words broadcast (an exact integer dot
// product), times the block's scale, the blocks summed in order.
template <typename KV>
SPECSERVE_VNNI void Split<KV>::score16_vnni(const Work& it, int64_t j0, int64_t g, const int8_t* const* keys,
                                            __m512 ks, float* scores, int8_t* transposed) const {
  const int64_t words = d / 4;
  __m512i kt[16];
  for (int64_t c = 0; c < d / 64; ++c) {
    transpose16(keys, g * head_width + 64 * c, kt);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(transposed + (16 * c + i) * 64, kt[i]);
  }
  for (int64_t r = it.row; r < it.row + it.rows; ++r) {
    if (len[r] - it.split * SPLIT - j0 <= 0) continue;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int32_t* qw = reinterpret_cast<const int32_t*>(query_int8 + (r * heads + h) * d);
      const float* block_scale = query_scale + (r * heads + h) * (d / 16);
      const int32_t* block_sum = query_sum + (r * heads + h) * (d / 16);
      __m512 dots = _mm512_setzero_ps();
      for (int64_t b = 0; b < d / 16; ++b) {      // a block's 4 words, one chain
        __m512i acc = _mm512_set1_epi32(-128 * block_sum[b]);
        for (int64_t w = 4 * b; w < 4 * b + 4; ++w)
          acc = dpbusd(acc, _mm512_loadu_si512(transposed + w * 64), _mm512_set1_epi32(qw[w]));
        dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(block_scale[b]), dots);
      }
      keep16(it, r, h, j0, dots, ks, scores);
    }
  }
}

// The AVX-512 path, for head_dim 16 DV: 16 keys at a time in slot order, for each KV head scored by score16 (keys
// widened once for the group's rows and query heads) or, for an int8 pool on a CPU with VNNI, score16_vnni; the K
// and V lines AHEAD keys on are requested meanwhile. Then the values weighed for up to 24 / DV query heads of a KV
// head at once, in key order. A key's score and a head's weighted values take the same operations whatever rows
// share the pass and wherever the key falls.
template <typename KV>
template <int DV>
SPECSERVE_AVX512 void Split<KV>::run_avx512(const Work& it, int64_t n_all, const KV* const* key_slots,
                                            const KV* const* value_slots, float* scores, float* widened) const {
  const int64_t lo = it.split * SPLIT, slot_bytes = slot_size * static_cast<int64_t>(sizeof(KV));
  const bool by_vnni = std::is_same_v<KV, int8_t> && vnni;
  const __m512 fscale = _mm512_set1_ps(scale);
  float key_scale[16];
  for (int64_t j0 = 0; j0 < n_all; j0 += 16) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t t = 0; t < 16; ++t) {
        if (g == 0 && j0 + t + AHEAD < n_all) {
          prefetch(key_slots[j0 + t + AHEAD], slot_bytes);
          prefetch(value_slots[j0 + t + AHEAD], slot_bytes);
        }
        const KV* k = key_slots[j0 + t] + g * head_width;
        key_scale[t] = head_scale(k, d);
        if (!by_vnni)
          for (int i = 0; i < DV; ++i) _mm512_storeu_ps(widened + (t * DV + i) * 16, load16(k + 16 * i));
      }
      const __m512 ks = _mm512_mul_ps(_mm512_loadu_ps(key_scale), fscale);
      if constexpr (std::is_same_v<KV, int8_t>) {
        if (by_vnni) {
          score16_vnni(it, j0, g, key_slots + j0, ks, scores, reinterpret_cast<int8_t*>(widened));
          continue;
        }
      }
      score16<DV>(it, j0, g, widened, ks, scores);
    }
  }
  constexpr int64_t CHUNK = 24 / DV;     // query heads weighed together: their accumulators fit in the registers
  const float* p[CHUNK];
  float* acc[CHUNK];
  for (int64_t r = it.row; r < it.row + it.rows; ++r) {
    const int64_t n = std::min(len[r] - lo, SPLIT), part = first[r] + it.split;
    if (n <= 0) continue;
    exponentiate(it, r, n, scores);
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += CHUNK) {
        const int64_t m = std::min(CHUNK, (g + 1) * group - h0);
        for (int64_t h = 0; h < m; ++h) {
          p[h] = scores + ((r - it.row) * heads + h0 + h) * split_keys;
          acc[h] = part_acc + (part * heads + h0 + h) * d;
        }
        weigh_heads<DV, CHUNK>(m, p, n, value_slots, g * head_width, d, acc);
      }
    }
  }
}

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
  const int64_t head_width = d + SCALE_ELEMS<KV>;
  TORCH_CHECK(k_pool.size(2) == head_width && v_pool.size(2) == head_width,
              "paged_attention_rows: a pool slot's KV head must hold head_dim values (int8: and 4 bytes of scale)");
  const int64_t group = heads / kv_heads, max_keys = seq_slots.size(1), slot_size = kv_heads * head_width;
  const float fscale = static_cast<float>(scale);
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* len = row_len.data_ptr<int64_t>();
  const int64_t* slots = seq_slots.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const KV* kp = static_cast<const KV*>(k_pool.data_ptr());
  const KV* vp = static_cast<const KV*>(v_pool.data_ptr());

  // The parts of row r (its splits' partial results): first[r] .. first[r + 1] - 1, in split order.
  std::vector<int64_t> first(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= max_keys, "row_len out of range");
    first[r + 1] = first[r] + (len[r] + SPLIT - 1) / SPLIT;
  }
  const int64_t parts = first[rows];
  std::vector<Work> work;
  int64_t group_rows = 1, split_keys = 1;      // the most rows in a group and keys in a split: the score buffer's size
  // a verify window alone still spreads over the threads
  const int64_t cap = std::clamp<int64_t>((rows + at::get_num_threads() - 1) / at::get_num_threads(), 1, ROW_GROUP);
  for (int64_t r0 = 0, r1; r0 < rows; r0 = r1) {
    int64_t longest = len[r0];
    for (r1 = r0 + 1; r1 < rows && r1 - r0 < cap && seq[r1] == seq[r0]; ++r1)
      longest = std::max(longest, len[r1]);
    for (int64_t s = 0; s * SPLIT < longest; ++s) work.push_back({r0, r1 - r0, s});
    group_rows = std::max(group_rows, r1 - r0);
    split_keys = std::max(split_keys, std::min(longest, SPLIT));
  }
  const int64_t items = static_cast<int64_t>(work.size());
  // per part and head: the split's max score, sum of exponentials and weighted values
  std::vector<float> part_max(parts * heads), part_sum(parts * heads), part_acc(parts * heads * d);

  static const bool avx512 = cpu_has_avx512(), vnni = cpu_has_vnni();
  std::optional<Queries> int8_queries;
  if constexpr (std::is_same_v<KV, int8_t>) int8_queries.emplace(qp, rows * heads, d);
  const Split<KV> ctx{int8_queries ? int8_queries->dequantized.data() : qp, len, heads, kv_heads, group, d,
                      head_width, slot_size, split_keys, fscale, first.data(), part_max.data(), part_sum.data(),
                      part_acc.data(), vnni, int8_queries ? int8_queries->values.data() : nullptr,
                      int8_queries ? int8_queries->scale.data() : nullptr,
                      int8_queries ? int8_queries->sum.data() : nullptr};
  const int64_t lanes16 = avx512 && d % 16 == 0 ? d / 16 : 0;     // the AVX-512 path's head_dim / 16, if it takes it
  std::atomic<int32_t> seen_sink{0};     // what `touch` read, kept so that its reads are not optimised away
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    int32_t seen = 0;
    std::vector<float> scores(group_rows * heads * split_keys);
    std::vector<float> widened(16 * d);
    std::vector<const KV*> key_slots(SPLIT + 16), value_slots(SPLIT);
    for (int64_t w = begin; w < end; ++w) {
      const Work& it = work[w];
      const int64_t lo = it.split * SPLIT;
      int64_t n_all = 0;                 // keys of the split that some row of the group attends
      for (int64_t r = it.row; r < it.row + it.rows; ++r) n_all = std::max(n_all, std::min(len[r] - lo, SPLIT));
      const int64_t* row_slots = slots + seq[it.row] * max_keys + lo;
      for (int64_t j = 0; j < n_all; ++j) {
        key_slots[j] = kp + row_slots[j] * slot_size;
        value_slots[j] = vp + row_slots[j] * slot_size;
      }
      for (int64_t j = n_all; j < n_all + 16; ++j) key_slots[j] = key_slots[0];    // padding lanes of the last keys
      for (int64_t r = it.row; r < it.row + it.rows; ++r) {
        if (len[r] <= lo) continue;
        float* tops = part_max.data() + (first[r] + it.split) * heads;
        std::fill(tops, tops + heads, -std::numeric_limits<float>::infinity());
      }
      if (lanes16 == 4) {
        ctx.template run_avx512<4>(it, n_all, key_slots.data(), value_slots.data(), scores.data(), widened.data());
      } else if (lanes16 == 8) {
        ctx.template run_avx512<8>(it, n_all, key_slots.data(), value_slots.data(), scores.data(), widened.data());
      } else {
        seen |= touch(key_slots.data(), value_slots.data(), n_all, slot_size);
        ctx.run_avx2(it, n_all, row_slots, key_slots.data(), value_slots.data(), scores.data(), widened.data());
      }
    }
    seen_sink += seen;
  });

  at::Tensor out = at::empty({rows, heads, d}, q.options());
  float* op = out.data_ptr<float>();
  // a decode row's heads merge on one thread: a parallel region costs more than their few hundred flops
  at::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u / heads, h = u % heads, w0 = first[r], splits = first[r + 1] - w0;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) m = std::max(m, part_max[(w0 + s) * heads + h]);
      float total = 0.0f;
      float* o = op + u * d;
      std::fill(o, o + d, 0.0f);
      for (int64_t s = 0; s < splits; ++s) {
        const float f = std::exp(part_max[(w0 + s) * heads + h] - m);
        total += f * part_sum[(w0 + s) * heads + h];
        const float* a = part_acc.data() + ((w0 + s) * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) o[i] += f * a[i];
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d; ++i) o[i] *= inv;
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
  if (k_pool.scalar_type() == at::kChar) return attend<int8_t>(q, k_pool, v_pool, row_seq, row_len, seq_slots, scale);
  TORCH_CHECK(k_pool.scalar_type() == at::kHalf, "paged_attention_rows takes float32, float16 or int8 pools");
  return attend<uint16_t>(q, k_pool, v_pool, row_seq, row_len, seq_slots, scale);
}

namespace {

// x rotated by the rotate-half rule (Hugging Face's): x * cos + [-x2, x1] * sin, the same operations as
// layers.apply_rope, so the same bits
inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

template <typename KV>
inline void store(const float* x, int64_t n, KV* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<KV>(x[i]);
}

// One KV head's d values into an int8 pool (ops.quantize_kv): quantize_head's integers, then its scale's 4 bytes.
inline void store_int8(const float* x, int64_t d, int8_t* dst) {
  const float scale = quantize_head(x, d, dst);
  std::memcpy(dst + d, &scale, sizeof scale);
}

// Checks a pool pair and returns (kv_heads, head_dim, head_width) for K/V rows of `width` values (K heads then V).
std::tuple<int64_t, int64_t, int64_t> pool_geometry(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t width,
                                                    const char* op) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == v_pool.scalar_type(), op,
              ": K and V pools must be contiguous and share a dtype");
  const bool int8 = k_pool.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || k_pool.scalar_type() == at::kHalf || k_pool.scalar_type() == at::kFloat, op,
              " takes float32, float16 or int8 pools");
  const int64_t kv_heads = k_pool.size(1), d = width / (2 * kv_heads);
  const int64_t head_width = d + (int8 ? SCALE_ELEMS<int8_t> : 0);
  TORCH_CHECK(k_pool.size(2) == head_width && v_pool.size(2) == head_width, op,
              ": a pool slot's KV head must hold head_dim values (int8: and 4 bytes of scale)");
  return {kv_heads, d, head_width};
}

// One row's K heads (kv_heads * d values, rotated already) and V heads into the pools' slot, in the pool's dtype.
void store_slot(const float* k, const float* v, int64_t slot, at::Tensor& k_pool, at::Tensor& v_pool,
                int64_t kv_heads, int64_t d, int64_t head_width) {
  const int64_t at = slot * kv_heads * head_width;
  if (k_pool.scalar_type() == at::kChar) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      store_int8(k + h * d, d, k_pool.data_ptr<int8_t>() + at + h * head_width);
      store_int8(v + h * d, d, v_pool.data_ptr<int8_t>() + at + h * head_width);
    }
  } else if (k_pool.scalar_type() == at::kHalf) {
    store(k, kv_heads * d, k_pool.data_ptr<at::Half>() + at);
    store(v, kv_heads * d, v_pool.data_ptr<at::Half>() + at);
  } else {
    store(k, kv_heads * d, k_pool.data_ptr<float>() + at);
    store(v, kv_heads * d, v_pool.data_ptr<float>() + at);
  }
}

}  // namespace

// One layer's attention from its fused QKV projection, in one op: rotary on the Q and K heads, the new K/V written
// into the pools at slot_mapping, then paged_attention_rows. qkv: [rows, (heads + 2 * kv_heads) * head_dim];
// cos, sin: [rows, head_dim] (any shape holding that); slot_mapping: [rows] → [rows, heads * head_dim]
at::Tensor paged_attention_qkv(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                               at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
                               const at::Tensor& row_seq, const at::Tensor& row_len, const at::Tensor& seq_slots,
                               int64_t heads, double scale) {
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "paged_attention_qkv takes float32 qkv, cos and sin");
  const int64_t rows = qkv.size(0), kv_heads = k_pool.size(1), d = qkv.size(1) / (heads + 2 * kv_heads);
  const int64_t head_width = std::get<2>(pool_geometry(k_pool, v_pool, 2 * kv_heads * d, "paged_attention_qkv"));
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d && cos.numel() == rows * d && sin.numel() == rows * d &&
              slot_mapping.numel() == rows, "paged_attention_qkv: qkv, cos, sin and slot_mapping disagree");
  at::Tensor q = at::empty({rows, heads, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> k(kv_heads * d);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = src + r * qkv.size(1);
      const float *c = cp + r * d, *s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * d, c, s, d, qp + (r * heads + h) * d);
      for (int64_t h = 0; h < kv_heads; ++h) rotate(x + (heads + h) * d, c, s, d, k.data() + h * d);
      store_slot(k.data(), x + (heads + kv_heads) * d, slots[r], k_pool, v_pool, kv_heads, d, head_width);
    }
  });
  return paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, scale).view({rows, heads * d});
}

// K/V rows without Q: the K heads rotated, then both written into the pools at slot_mapping, as paged_attention_qkv
// writes them. kv: [rows, 2 * kv_heads * head_dim]; cos, sin: [rows, head_dim]; slot_mapping: [rows]
void write_kv(const at::Tensor& kv_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor& k_pool,
              at::Tensor& v_pool, const at::Tensor& slot_mapping) {
  const at::Tensor kv = kv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(kv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "write_kv takes float32 kv, cos and sin");
  const int64_t rows = kv.size(0);
  const auto [kv_heads, d, head_width] = pool_geometry(k_pool, v_pool, kv.size(1), "write_kv");
  TORCH_CHECK(kv.size(1) == 2 * kv_heads * d && cos.numel() == rows * d && sin.numel() == rows * d &&
              slot_mapping.numel() == rows, "write_kv: kv, cos, sin and slot_mapping disagree");
  const float* src = kv.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> k(kv_heads * d);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = src + r * kv.size(1);
      const float *c = cos.data_ptr<float>() + r * d, *s = sin.data_ptr<float>() + r * d;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(x + h * d, c, s, d, k.data() + h * d);
      store_slot(k.data(), x + kv_heads * d, slots[r], k_pool, v_pool, kv_heads, d, head_width);
    }
  });
}

// K or V heads into an int8 pool's layout (store_int8 per head): x: [..., head_dim] → [..., head_dim + 4] int8.
at::Tensor quantize_kv(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "quantize_kv takes float32 [..., head_dim]");
  const int64_t d = x.size(-1), heads = d ? x.numel() / d : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d + SCALE_ELEMS<int8_t>;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kChar));
  const float* src = x.data_ptr<float>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t h = 0; h < heads; ++h) store_int8(src + h * d, d, dst + h * (d + SCALE_ELEMS<int8_t>));
  return out;
}

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("quantize_kv(Tensor x) -> Tensor");
  m.impl("quantize_kv", c10::DispatchKey::CPU, &quantize_kv);
  m.def("paged_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor slot_mapping, Tensor row_seq, Tensor row_len, Tensor seq_slots, int heads, float scale) -> Tensor");
  m.impl("paged_attention_qkv", c10::DispatchKey::CPU, &paged_attention_qkv);
  m.def("paged_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor row_seq, Tensor row_len, "
        "Tensor seq_slots, float scale) -> Tensor");
  m.impl("paged_attention_rows", c10::DispatchKey::CPU, &paged_attention_rows);
}
