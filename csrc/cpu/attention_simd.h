// SIMD levels of the CPU attention kernels (which ones the build target has) and the vector
// math they share: GCC vector types per level, load / store / fused multiply-add, lane
// reductions and exp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_kernels.h"

namespace vllm_kv::cpu::attention {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VLLM_KV_HAVE_AVX512 1
#endif
// The bf16 dot path (VBMI spreads the NVFP4 codes).
#if defined(VLLM_KV_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define VLLM_KV_HAVE_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VLLM_KV_HAVE_AVX2 1
#endif

// Whether the build target has the instructions of `level` (kGeneric always).
constexpr bool simd_level_compiled(SimdLevel level) {
  switch (level) {
    case SimdLevel::kGeneric:
      return true;
    case SimdLevel::kAvx2:
#if defined(VLLM_KV_HAVE_AVX2)
      return true;
#else
      return false;
#endif
    case SimdLevel::kAvx512:
#if defined(VLLM_KV_HAVE_AVX512)
      return true;
#else
      return false;
#endif
    case SimdLevel::kAuto:
      return true;
  }
  return false;
}

constexpr SimdLevel widest_simd_level() {
  if (simd_level_compiled(SimdLevel::kAvx512)) return SimdLevel::kAvx512;
  if (simd_level_compiled(SimdLevel::kAvx2)) return SimdLevel::kAvx2;
  return SimdLevel::kGeneric;
}

// ------------------------------------------------------------------------------ vector math

template <int kBytes>
struct FloatVecOf {
  typedef float type __attribute__((vector_size(kBytes)));
};

template <SimdLevel L>
inline constexpr int kVecBytes = L == SimdLevel::kAvx512 ? 64
                                 : L == SimdLevel::kAvx2 ? 32
                                                         : 16;

template <SimdLevel L>
using VecF = typename FloatVecOf<kVecBytes<L>>::type;

template <SimdLevel L>
inline constexpr int kLanes = kVecBytes<L> / 4;

template <SimdLevel L>
inline VecF<L> load(const float* p) {
  VecF<L> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <SimdLevel L>
inline void store(float* p, VecF<L> v) {
  std::memcpy(p, &v, sizeof(v));
}

// x in every lane. (x - 0 is x for every x, -0 included, so this folds to a broadcast; 0 + x
// would not, as 0 + -0 is +0.)
template <SimdLevel L>
inline VecF<L> splat(float x) {
  return x - VecF<L>{};
}

// a * b + c, fused where the level has FMA (the file is built with -ffp-contract=off for the
// bit-exact quantizers, so fusion is spelled out).
template <SimdLevel L>
inline VecF<L> fmadd(VecF<L> a, VecF<L> b, VecF<L> c) {
#if defined(VLLM_KV_HAVE_AVX512)
  if constexpr (L == SimdLevel::kAvx512) return _mm512_fmadd_ps(a, b, c);
#endif
#if defined(VLLM_KV_HAVE_AVX2)
  if constexpr (L == SimdLevel::kAvx2) return _mm256_fmadd_ps(a, b, c);
#endif
  return a * b + c;
}

template <SimdLevel L>
inline VecF<L> vmax(VecF<L> a, VecF<L> b) {
  return a > b ? a : b;
}

// Sum of the lanes, by halving.
template <int kN, typename V, size_t... kI>
inline auto low_half(V v, std::index_sequence<kI...>) {
  return __builtin_shufflevector(v, v, kI...);
}
template <int kN, typename V, size_t... kI>
inline auto high_half(V v, std::index_sequence<kI...>) {
  return __builtin_shufflevector(v, v, (kI + kN / 2)...);
}

template <int kN, typename V>
inline float reduce_add(V v) {
  if constexpr (kN == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    const auto lo = low_half<kN>(v, std::make_index_sequence<kN / 2>{});
    const auto hi = high_half<kN>(v, std::make_index_sequence<kN / 2>{});
    return reduce_add<kN / 2>(lo + hi);
  }
}

template <int kN, typename V>
inline float reduce_max(V v) {
  if constexpr (kN == 4) {
    return std::max(std::max(v[0], v[2]), std::max(v[1], v[3]));
  } else {
    const auto lo = low_half<kN>(v, std::make_index_sequence<kN / 2>{});
    const auto hi = high_half<kN>(v, std::make_index_sequence<kN / 2>{});
    return reduce_max<kN / 2>(lo > hi ? lo : hi);
  }
}

template <SimdLevel L>
using VecI = decltype(VecF<L>{} > VecF<L>{});

// Lane sums of kN vectors at once (a transposing tree): out[t] = sum of the lanes of v[t]. One
// level pairs neighbours a, b holding kN / kS tokens of kS partial sums each into one vector of
// twice the tokens with kS / 2 partials each (lane j: token j / (kS / 2), a's tokens first).
constexpr int fold_source(int lanes, int partials, int j, int second) {
  const int half = partials / 2;
  const int token = j / half;
  const int per_vector = lanes / partials;
  const int from_b = token < per_vector ? 0 : lanes;
  return from_b + (token % per_vector) * partials + j % half + second * half;
}

template <int kN, int kS, typename V, size_t... kI>
inline V fold_pair(V a, V b, std::index_sequence<kI...>) {
  return __builtin_shufflevector(a, b, fold_source(kN, kS, kI, 0)...) +
         __builtin_shufflevector(a, b, fold_source(kN, kS, kI, 1)...);
}

// v holds kS vectors of kN lanes (kS = kN at the top); overwritten.
template <int kN, int kS = kN, typename V>
inline V reduce_add_many(V* v) {
  if constexpr (kS == 1) {
    return v[0];
  } else {
    for (int k = 0; k < kS / 2; ++k) {
      v[k] = fold_pair<kN, kS>(v[2 * k], v[2 * k + 1], std::make_index_sequence<kN>{});
    }
    return reduce_add_many<kN, kS / 2>(v);
  }
}

// p(r), r = x - k ln2 (x clamped to >= -87) in [-ln2/2, ln2/2]: a degree-6 Taylor polynomial
// (relative error ~2e-7).
template <SimdLevel L>
inline VecF<L> exp_reduced(VecF<L> clamped, VecF<L> k) {
  // r in two steps (ln2 = hi + lo, hi exact in 16 bits) to keep it accurate.
  const VecF<L> r = fmadd<L>(k, splat<L>(-1.428606765330187e-06f),
                             fmadd<L>(k, splat<L>(-0.693145751953125f), clamped));
  VecF<L> p = splat<L>(1.0f / 720.0f);
  p = fmadd<L>(p, r, splat<L>(1.0f / 120.0f));
  p = fmadd<L>(p, r, splat<L>(1.0f / 24.0f));
  p = fmadd<L>(p, r, splat<L>(1.0f / 6.0f));
  p = fmadd<L>(p, r, splat<L>(0.5f));
  p = fmadd<L>(p, r, splat<L>(1.0f));
  return fmadd<L>(p, r, splat<L>(1.0f));
}

// exp(x) for x <= 0 (x < -87, -inf included, gives 0): 2^k * p(r) with k = round(x / ln2).
// NaN stays NaN (the clamp would turn it into a weight of ~0): a NaN score poisons its row, as
// in the reference.
template <SimdLevel L>
inline VecF<L> vexp(VecF<L> x) {
  using V = VecF<L>;
  using I = VecI<L>;
  const V clamped = vmax<L>(x, splat<L>(-87.0f));
  const V t = fmadd<L>(clamped, splat<L>(1.44269504088896341f), splat<L>(0.5f));
#if defined(VLLM_KV_HAVE_AVX512)
  if constexpr (L == SimdLevel::kAvx512) {
    // Floor by vrndscaleps, 2^k p by vscalefps (exact: 2^k p is normal for k >= -125): the bits
    // of the steps below (at AVX2) for every x <= 88 in 15 instructions instead of 22
    // (check_paged_attention_cpu compares them on every x <= 0 and NaN).
    const V k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __mmask16 above = _mm512_cmp_ps_mask(x, splat<L>(-87.0f), _CMP_GE_OQ);
    const V e = _mm512_maskz_scalef_ps(above, exp_reduced<L>(clamped, k), k);
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
  }
#endif
  V k = __builtin_convertvector(__builtin_convertvector(t, I), V);  // toward zero
  k = k > t ? k - 1.0f : k;                                         // floor
  const I bits = (__builtin_convertvector(k, I) + 127) << 23;
  V two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  const V e = x < splat<L>(-87.0f) ? splat<L>(0.0f) : exp_reduced<L>(clamped, k) * two_k;
  return x != x ? x : e;
}

}  // namespace vllm_kv::cpu::attention
