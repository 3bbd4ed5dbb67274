// The online softmax of the CPU attention kernels' decode rows, 16 keys at a time (AVX-512): up
// to four query rows of a KV head share each transposing reduction (their maxima, their sums),
// and the exponential is a polynomial scaled by vscalefps. Used by the page loop for bf16 queries
// and by the NVFP4 chunk path; fp32 and fp16 queries and the other levels take
// TileMath::softmax_step row by row (softmax_rows).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/attention_simd.h"
#include "cpu/attention_tile.h"

namespace vllm_kv::cpu::attention {

#if defined(VLLM_KV_HAVE_AVX512)

// exp(x) for x <= 0 (-inf gives 0, NaN stays NaN so that it poisons its row, as in the
// reference): 2^k * 2^f with t = x log2(e), k = round(t), f = t - k in [-1/2, 1/2], 2^f by its
// degree-6 Taylor polynomial (relative error ~1e-7 plus t's rounding), the product by vscalefps
// (t clamped at -200: 0 exactly).
inline __m512 exp_scalef(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-200.0f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  // ln(2)^n / n!
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  // (vmaxps returns its second operand for a NaN x: put the NaN back.)
  return _mm512_mask_mov_ps(_mm512_scalef_ps(p, k), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

// out[i] = op-reduction of the 16 lanes of v[i]. Four rows share one transposing tree. (The
// shuffles in their zero-masking forms under a full mask: see transpose_16x16.)
template <int kRows, typename Op>
inline void reduce_rows(const __m512 (&v)[kRows], Op op, float (&out)[kRows]) {
  if constexpr (kRows == 4) {
    // a: lanes 0-7 v[0]'s halves combined, 8-15 v[1]'s; b likewise for v[2], v[3]; c: 128-bit
    // lane r holds row r's four partials; then within each 128-bit lane.
    const __m512 a = op(_mm512_maskz_shuffle_f32x4(0xFFFF, v[0], v[1], 0x44),
                        _mm512_maskz_shuffle_f32x4(0xFFFF, v[0], v[1], 0xEE));
    const __m512 b = op(_mm512_maskz_shuffle_f32x4(0xFFFF, v[2], v[3], 0x44),
                        _mm512_maskz_shuffle_f32x4(0xFFFF, v[2], v[3], 0xEE));
    const __m512 c = op(_mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0x88),
                        _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0xDD));
    const __m512 d = op(c, _mm512_maskz_permute_ps(0xFFFF, c, 0x4E));
    const __m512 e = op(d, _mm512_maskz_permute_ps(0xFFFF, d, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, e);
    for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
  } else {
    for (int i = 0; i < kRows; ++i) {
      __m512 x = v[i];
      x = op(x, _mm512_maskz_shuffle_f32x4(0xFFFF, x, x, 0x4E));
      x = op(x, _mm512_maskz_shuffle_f32x4(0xFFFF, x, x, 0xB1));
      x = op(x, _mm512_maskz_permute_ps(0xFFFF, x, 0x4E));
      x = op(x, _mm512_maskz_permute_ps(0xFFFF, x, 0xB1));
      out[i] = _mm512_cvtss_f32(x);
    }
  }
}

// How far a score may exceed its row's running maximum before the maximum is moved (natural
// log units: weights up to 2^8, far from fp32's range). Softmax is the same whatever maximum is
// subtracted; a stale one spares the keys their maximum reduction.
inline constexpr float kMaxSlack = 5.5451774f;  // ln(256)

// Whether every row's running maximum m[i] may stay for scores whose lane-wise maxima are top[i]:
// it is finite and none exceeds it by over kMaxSlack.
template <int kRows>
inline bool maxima_hold(const __m512 (&top)[kRows], const float* m) {
  bool hold = true;
  for (int i = 0; i < kRows; ++i) {
    hold &= m[i] != -std::numeric_limits<float>::infinity() &&
            _mm512_cmp_ps_mask(top[i], _mm512_set1_ps(m[i] + kMaxSlack), _CMP_GT_OQ) == 0;
  }
  return hold;
}

// Moves each row's running maximum to the largest lane of top[i] where that is larger, its sum
// l[i] and accumulator (row stride dim_v floats) rescaled.
template <int kRows>
inline void move_maxima(const __m512 (&top)[kRows], float* m, float* l, float* acc, int dim_v) {
  float largest[kRows];
  reduce_rows<kRows>(top, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }, largest);
  for (int i = 0; i < kRows; ++i) {
    if (!(largest[i] > m[i])) continue;
    const float correction = std::exp(m[i] - largest[i]);  // 0 for the first keys
    l[i] *= correction;
    float* a = acc + int64_t(i) * dim_v;
    for (int d = 0; d < dim_v; d += 16) {
      _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(correction)));
    }
    m[i] = largest[i];
  }
}

// exp(s - m) on the valid lanes, 0 elsewhere and for a row without a finite score yet (m = -inf).
inline __m512 softmax_weights(__m512 s, float m, __mmask16 valid) {
  if (m == -std::numeric_limits<float>::infinity()) return _mm512_setzero_ps();
  return _mm512_maskz_mov_ps(valid, exp_scalef(_mm512_sub_ps(s, _mm512_set1_ps(m))));
}

// Online-softmax update of kRows rows with 16 keys' scores (row i's at scores + i *
// score_stride; keys outside valid[i] ignored): weights[i] = exp(s - m[i]) on valid[i], 0
// elsewhere, added into the sums l. The maxima m move (maxima_hold, move_maxima) only when a row
// has none yet or a score exceeds it by over kMaxSlack. A row without a finite score keeps its
// state (weights 0).
template <int kRows>
inline void softmax_chunk(const float* scores, int64_t score_stride, const __mmask16* valid,
                          float* m, float* l, float* acc, int dim_v, __m512 (&weights)[kRows]) {
  __m512 s[kRows];
  for (int i = 0; i < kRows; ++i) {
    s[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid[i],
                                scores + i * score_stride);
  }
  if (!maxima_hold<kRows>(s, m)) move_maxima<kRows>(s, m, l, acc, dim_v);
  for (int i = 0; i < kRows; ++i) weights[i] = softmax_weights(s[i], m[i], valid[i]);
  float sums[kRows];
  reduce_rows<kRows>(weights, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }, sums);
  for (int i = 0; i < kRows; ++i) l[i] += sums[i];
}

// The same for kRows rows over keys [b, e) of their score rows (any length; row stride
// score_stride): one maximum step for all the keys (their weights are summed into the
// accumulators together, after it), the weights stored over the scores in 16-key steps (0
// outside [b, e), which readers of whole steps or key pairs take).
template <int kRows>
inline void softmax_keys(float* scores, int64_t score_stride, int b, int e, float* m, float* l,
                         float* acc, int dim_v) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto valid = [&](int t0) {
    const int lo = std::max(b, t0) - t0;
    const int hi = std::min(e, t0 + 16) - t0;
    return __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
  };
  __m512 top[kRows];
  for (int i = 0; i < kRows; ++i) top[i] = _mm512_set1_ps(neg_inf);
  for (int t0 = b - b % 16; t0 < e; t0 += 16) {
    for (int i = 0; i < kRows; ++i) {
      top[i] = _mm512_max_ps(top[i], _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), valid(t0),
                                                          scores + i * score_stride + t0));
    }
  }
  if (!maxima_hold<kRows>(top, m)) move_maxima<kRows>(top, m, l, acc, dim_v);
  __m512 sum[kRows];
  for (int i = 0; i < kRows; ++i) sum[i] = _mm512_setzero_ps();
  for (int t0 = b - b % 16; t0 < e; t0 += 16) {
    for (int i = 0; i < kRows; ++i) {
      float* row = scores + i * score_stride + t0;
      const __m512 w = softmax_weights(
          _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), valid(t0), row), m[i], valid(t0));
      _mm512_storeu_ps(row, w);
      sum[i] = _mm512_add_ps(sum[i], w);
    }
  }
  float sums[kRows];
  reduce_rows<kRows>(sum, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }, sums);
  for (int i = 0; i < kRows; ++i) l[i] += sums[i];
}

#endif  // VLLM_KV_HAVE_AVX512

// The online-softmax step of `rows` query rows over the same keys [b, e) (offsets into their
// score rows, stride shape.tokens; none when b >= e): maxima m, sums l and accumulators (stride
// shape.dim_v) updated, the weights written over the scores. `deferred` (rows whose value
// weights are rounded to bf16, those of a bf16 query) on AVX-512: four rows at a time with a
// deferred maximum (softmax_keys); otherwise TileMath::softmax_step per row, whose weights are
// the reference's to fp32 rounding (the polynomial above and a stale maximum move them by ~1e-6,
// which through a model's next layers' K / V quantization moved held-out perplexities by up to
// 1.5%).
template <SimdLevel L>
inline void softmax_rows(const RowShape& shape, float* scores, int b, int e, int rows, float* m,
                         float* l, float* acc, [[maybe_unused]] bool deferred) {
  if (b >= e) return;
#if defined(VLLM_KV_HAVE_AVX512)
  if (L == SimdLevel::kAvx512 && deferred) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      softmax_keys<4>(scores + int64_t(r) * shape.tokens, shape.tokens, b, e, m + r, l + r,
                      acc + int64_t(r) * shape.dim_v, shape.dim_v);
    }
    for (; r < rows; ++r) {
      softmax_keys<1>(scores + int64_t(r) * shape.tokens, shape.tokens, b, e, m + r, l + r,
                      acc + int64_t(r) * shape.dim_v, shape.dim_v);
    }
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    TileMath<L>::softmax_step(shape, scores + int64_t(r) * shape.tokens, b, e, m[r], l[r],
                              acc + int64_t(r) * shape.dim_v);
  }
}

}  // namespace vllm_kv::cpu::attention
