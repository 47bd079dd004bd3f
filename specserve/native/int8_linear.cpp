// An int8 linear in one op, for any number of rows: the row's input side (the layer's RMSNorm or SiLU gating), its
// 8-bit quantization in groups of 128 inputs, the int8 x int8 product accumulated exactly in int32 within a group,
// and the float epilogue.
//
// Why our own: fbgemm's dynamic linear (used before) runs a one-row product at about half the speed a memory read
// allows on the 2-core hosts of this project, and quantizes with one scale per call, which needed nine small torch
// ops around it to stay per-row. Here every row is computed alone, in one fixed order of operations: a row's bits
// never depend on the rows beside it (the integer sums are exact in any order, the float sums run over the groups in
// order), so speculation reproduces plain decoding; and a decode step streams the weights once over both cores.
//
// Activations: q = round(127 h / max|h|) in [-127, 127] with one scale per row and group of 128 inputs (one scale per
// row cost SmolLM2 2.6 points of NLL more: per-token outliers flatten the rest of the row). Weights: 8 bits per output
// channel. x86 without VNNI multiplies with _mm256_maddubs_epi16 (uint8 x int8, pairs summed into int16 with
// saturation): it takes |q| and the weight with q's sign, and 2 * 127 * 127 < 32767 never saturates.
//
// Two weight layouts, two paths (ops.pack writes the one the CPU suits): blocks of 4 channels x 32 inputs, whose
// dot products end in horizontal sums (AVX2); and blocks of 16 channels x 4 inputs, one channel per 32-bit lane,
// for AVX-512 VNNI, whose _mm512_dpbusd_epi32 adds four uint8 x int8 products into each lane's int32: it takes
// q + 128 and subtracts 128 times the weights' sum. Both give every group the same exact integer and apply the
// same float steps to it, so the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

using namespace specserve;

namespace {

constexpr int64_t GROUP = 128;        // inputs per activation scale: 4 steps of 32
constexpr int64_t ROW_CHUNK = 48;     // rows whose activations stay in L2 while every channel block reads them

// h = silu(gate) * up for a row [gate (n) | up (n)]; sigmoid from e^-|g|, so that the exponential never overflows
void gated(const float* x, int64_t n, float* h) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(x + i);
    const __m256 e = exp8(_mm256_or_ps(g, sign));
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
    _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(x + n + i)));
  }
  for (; i < n; ++i) h[i] = x[i] / (1.0f + std::exp(-x[i])) * x[n + i];
}

// h → int8 q over [0, k_pad) (zero past n), one scale max|h| / 127 per group of GROUP inputs in scales
void quantize(const float* h, int64_t n, int64_t k_pad, int8_t* a, float* scales) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g0 = 0; g0 < k_pad; g0 += GROUP) {
    const int64_t g1 = std::min(n, g0 + GROUP);
    __m256 peak8 = _mm256_setzero_ps();
    int64_t i = g0;
    for (; i + 8 <= g1; i += 8) peak8 = _mm256_max_ps(peak8, _mm256_andnot_ps(sign, _mm256_loadu_ps(h + i)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, peak8);
    float peak = 0.0f;
    for (float lane : lanes) peak = std::max(peak, lane);
    for (; i < g1; ++i) peak = std::max(peak, std::fabs(h[i]));
    const float inv = peak > 1e-30f ? 127.0f / peak : 0.0f;     // a zero group stays zero
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (i = g0; i + 8 <= g1; i += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(h + i), inv8));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(a + i), _mm_packs_epi16(words, words));
    }
    for (; i < g1; ++i) a[i] = static_cast<int8_t>(std::nearbyint(h[i] * inv));
    for (i = std::max(g0, g1); i < std::min(k_pad, g0 + GROUP); ++i) a[i] = 0;
    scales[g0 / GROUP] = peak / 127.0f;
  }
}

// The 4 channels' sums [c0, c1, c2, c3] of 8 int32 lanes each.
inline __m128i sum4(const __m256i acc[4]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// dots[r][c] = sum over groups g of (sum_k a[r][k] * w[c][k] over g) * scales[r][g], for R rows and the 4 channels
// of one weight block, k over k_pad (a multiple of 32); the block holds each channel's 32 weights of a step side by
// side, so it is read as one stream. Each group's sums are exact in int32; the float sum runs over the groups in
// order, a multiply and an add each (no FMA), the same for a row in any tile.
template <int R>
inline void tile(const int8_t* a, const float* scales, int64_t groups, const int8_t* block, int64_t k_pad,
                 float dots[R][4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m128 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm_setzero_ps();
  for (int64_t k0 = 0; k0 < k_pad; k0 += GROUP) {
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_si256();
    for (int64_t k = k0; k < std::min(k_pad, k0 + GROUP); k += 32) {
      __m256i av[R], magnitude[R];
      for (int r = 0; r < R; ++r) {
        av[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * k_pad + k));
        magnitude[r] = _mm256_abs_epi8(av[r]);
      }
      const int8_t* wk = block + 4 * k;
      for (int c = 0; c < 4; ++c) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * c));
        for (int r = 0; r < R; ++r) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[r], _mm256_sign_epi8(wv, av[r]));
          acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      total[r] = _mm_add_ps(total[r], _mm_mul_ps(_mm_cvtepi32_ps(sum4(acc[r])),
                                                 _mm_set1_ps(scales[r * groups + k0 / GROUP])));
  }
  for (int r = 0; r < R; ++r) _mm_storeu_ps(dots[r], total[r]);
}

// What a product reads and writes, whichever path computes it.
struct Operands {
  const int8_t* a;           // [rows, k_pad] (q + 128 for the VNNI path)
  const float* a_scale;      // [rows, groups]
  int64_t groups;
  const int8_t* w;           // [blocks of 4 channels, k_pad / 32, 4, 32] or [blocks of 16, k_pad / 4, 16, 4]
  const float* w_scale;      // [channels]
  const float* bias;         // [channels] or null
  const float* residual;     // [rows, channels] or null
  float* out;                // [rows, channels]
  int64_t channels, k_pad;
};

struct Product : Operands {
  template <int R>
  void block(int64_t r0, int64_t c0) const {
    float dots[R][4];
    tile<R>(a + r0 * k_pad, a_scale + r0 * groups, groups, w + c0 * k_pad, k_pad, dots);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4 && c0 + c < channels; ++c) {
        const int64_t j = c0 + c;
        float y = dots[r][c] * w_scale[j];
        if (bias) y += bias[j];
        if (residual) y = residual[(r0 + r) * channels + j] + y;
        out[(r0 + r) * channels + j] = y;
      }
  }

  void rows_of(int64_t r0, int64_t r1, int64_t c0) const {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) block<2>(r, c0);
    if (r1 - r == 1) block<1>(r, c0);
  }
};

constexpr int64_t LANES = 16;         // output channels of a VNNI block, one per 32-bit lane of a 512-bit register

// q + 128 as uint8, what dpbusd's unsigned operand takes
SPECSERVE_VNNI void shift(int8_t* a, int64_t n) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) _mm512_storeu_si512(a + i, _mm512_xor_si512(_mm512_loadu_si512(a + i), bias));
  for (; i < n; ++i) a[i] = static_cast<int8_t>(a[i] ^ 0x80);
}

struct ProductVnni : Operands {
  // R rows x the 16 channels from c0: per group, acc = (q + 128) . w and offset = 128 . w lane by lane, and the
  // float total adds (acc - offset) * the row's group scale, a multiply and an add as the AVX2 path.
  template <int R>
  SPECSERVE_VNNI void block(int64_t r0, int64_t c0) const {
    constexpr int CHAINS = R < 4 ? 4 / R : 1;      // a group's 32 steps divide by 4
    const __m512i bias128 = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* blk = w + c0 * k_pad;
    const int8_t* rows_a = a + r0 * k_pad;
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k_pad; k0 += GROUP) {
      const int64_t k1 = std::min(k_pad, k0 + GROUP);
      // CHAINS accumulators per row take turns over the steps, so that few rows do not wait on dpbusd's latency
      __m512i acc[CHAINS][R], offset[CHAINS];
      for (int j = 0; j < CHAINS; ++j) {
        offset[j] = _mm512_setzero_si512();
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_si512();
      }
      for (int64_t k = k0; k < k1; k += 4 * CHAINS) {
        for (int j = 0; j < CHAINS; ++j) {
          const __m512i wv = _mm512_loadu_si512(blk + LANES * (k + 4 * j));
          offset[j] = dpbusd(offset[j], bias128, wv);
          for (int r = 0; r < R; ++r) {
            int32_t quad;
            std::memcpy(&quad, rows_a + r * k_pad + k + 4 * j, 4);
            acc[j][r] = dpbusd(acc[j][r], _mm512_set1_epi32(quad), wv);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512i exact = _mm512_sub_epi32(acc[0][r], offset[0]);
        for (int j = 1; j < CHAINS; ++j) exact = _mm512_add_epi32(exact, _mm512_sub_epi32(acc[j][r], offset[j]));
        total[r] = _mm512_add_ps(total[r], _mm512_mul_ps(_mm512_cvtepi32_ps(exact),
                                                         _mm512_set1_ps(a_scale[(r0 + r) * groups + k0 / GROUP])));
      }
    }
    const __mmask16 live = channels - c0 >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << (channels - c0)) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(live, w_scale + c0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_mul_ps(total[r], scale);
      if (bias) y = _mm512_add_ps(y, b);
      if (residual) y = _mm512_add_ps(_mm512_maskz_loadu_ps(live, residual + (r0 + r) * channels + c0), y);
      _mm512_mask_storeu_ps(out + (r0 + r) * channels + c0, live, y);
    }
  }

  void rows_of(int64_t r0, int64_t r1, int64_t c0) const {
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) block<8>(r, c0);
    if (r1 - r >= 4) { block<4>(r, c0); r += 4; }
    if (r1 - r >= 2) { block<2>(r, c0); r += 2; }
    if (r1 - r == 1) block<1>(r, c0);
  }
};

}  // namespace

// x: [rows, in] float32 ([rows, 2 * in] with glu); norm_weight: [in]; weight: int8 [ceil(out / 4), k_pad / 32, 4,
// 32], or [ceil(out / 16), k_pad / 4, 16, 4] for VNNI (k_pad: in rounded up to 32; zero-padded; see ops.pack);
// weight_scale: [out] float32; bias: [out];
// residual: [rows, out], added to the result (the layer's residual stream) → [rows, out] float32
at::Tensor int8_linear(const at::Tensor& x_in, const std::optional<at::Tensor>& norm_weight, double eps, bool glu,
                       const at::Tensor& weight, const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "int8_linear takes [rows, in] float32");
  TORCH_CHECK(!(glu && norm_weight.has_value()), "int8_linear: glu or a norm, not both");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.dim() == 4,
              "int8_linear: weight must be int8 [out / 4, in / 32, 4, 32] or [out / 16, in / 4, 16, 4]");
  const bool vnni = weight.size(2) == LANES && weight.size(3) == 4;
  TORCH_CHECK(vnni || (weight.size(2) == 4 && weight.size(3) == 32),
              "int8_linear: weight must be int8 [out / 4, in / 32, 4, 32] or [out / 16, in / 4, 16, 4]");
  static const bool has_vnni = cpu_has_vnni();
  TORCH_CHECK(!vnni || has_vnni, "int8_linear: weights packed for AVX-512 VNNI, which this CPU lacks; pack them "
              "with vnni=False");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), width = x.size(1), n = glu ? width / 2 : width;
  const int64_t block_channels = vnni ? LANES : 4;
  const int64_t channels = weight_scale.numel(), k_pad = vnni ? weight.size(1) * 4 : weight.size(1) * 32;
  TORCH_CHECK(weight.size(0) == (channels + block_channels - 1) / block_channels,
              "int8_linear: weight and weight_scale disagree on the output channels");
  TORCH_CHECK(k_pad % 32 == 0, "int8_linear: a VNNI weight's inputs must be padded to a multiple of 32 (see ops.pack)");
  TORCH_CHECK((!glu || width % 2 == 0) && n <= k_pad && k_pad - n < 32, "int8_linear: input width ", width,
              " does not fit a weight of width ", k_pad);
  const float* wn = nullptr;
  at::Tensor norm;
  if (norm_weight.has_value()) {
    norm = norm_weight->contiguous();
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == n, "int8_linear: norm weight must be float32 [in]");
    wn = norm.data_ptr<float>();
  }
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == channels, "int8_linear: bias must be float32 [out]");
  }
  at::Tensor residual;
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.dim() == 2 && residual.size(0) == rows &&
                residual.size(1) == channels, "int8_linear: residual must be float32 [rows, out]");
  }
  const int64_t groups = (k_pad + GROUP - 1) / GROUP;
  std::vector<int8_t> a(rows * k_pad);
  std::vector<float> a_scale(rows * groups);
  const float* xp = x.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * width;
      const float* src = row;
      if (glu || wn) {
        if (glu) gated(row, n, h.data());
        else normed(row, n, wn, feps, h.data());
        src = h.data();
      }
      quantize(src, n, k_pad, a.data() + r * k_pad, a_scale.data() + r * groups);
      if (vnni) shift(a.data() + r * k_pad, k_pad);
    }
  });
  at::Tensor out = at::empty({rows, channels}, x.options());
  const int64_t blocks = weight.size(0);
  const auto each_block = [&](const auto& product, int64_t grain) {
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
      const int64_t r1 = std::min(rows, r0 + ROW_CHUNK);
      at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        for (int64_t blk = begin; blk < end; ++blk) product.rows_of(r0, r1, blk * block_channels);
      });
    }
  };
  const Operands operands{a.data(), a_scale.data(), groups, weight.data_ptr<int8_t>(), weight_scale.data_ptr<float>(),
                          b.defined() ? b.data_ptr<float>() : nullptr,
                          residual.defined() ? residual.data_ptr<float>() : nullptr, out.data_ptr<float>(), channels,
                          k_pad};
  if (vnni)
    each_block(ProductVnni{operands}, 2);
  else
    each_block(Product{operands}, 8);
  return out;
}

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("int8_linear(Tensor x, Tensor? norm_weight, float eps, bool glu, Tensor weight, Tensor weight_scale, "
        "Tensor? bias, Tensor? residual=None) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}
