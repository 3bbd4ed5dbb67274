// Memory access and source element types of the CUDA reshape_and_cache_flash kernels
// (reshape_and_cache_flash.cuh): vector loads / stores of little-endian words and the exact
// widening of a source element to fp32. __host__ __device__, so that the kernels' per-thread
// work can be replayed on the host in tests (csrc/cuda/tests/); torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../cache_kernels.h"
#include "../kv_quant_math.h"

namespace vllm_kv::gpu {

// ---------------------------------------------------------------------------------------------
// Memory access helpers (the host branches exist only for host-side replays in tests).

template <typename T>
KV_HOST_DEVICE T load_readonly(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

KV_HOST_DEVICE constexpr int words_for_bytes(int bytes) { return (bytes + 3) / 4; }

#if !defined(__CUDA_ARCH__)
// Host replays (tests) stop at an access the GPU would fault on: a vector access must be aligned.
inline void host_replay_check_alignment(const void* p, int alignment) {
  if (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(alignment) != 0) {
    std::fprintf(stderr, "reshape_and_cache_flash replay: %d-byte access at misaligned %p\n",
                 alignment, p);
    std::abort();
  }
}
#endif

// Reads kBytes bytes at p, kWord bytes per access (p aligned to kWord), into little-endian 32-bit
// words; bytes past kBytes in the last word are zero.
template <int kBytes, int kWord>
KV_HOST_DEVICE void load_bytes(const uint8_t* p, uint32_t (&w)[words_for_bytes(kBytes)]) {
  static_assert(kWord == 1 || kWord == 2 || kWord == 4 || kWord == 8 || kWord == 16, "word size");
  static_assert(kBytes % kWord == 0, "kBytes must be a multiple of kWord");
#if defined(__CUDA_ARCH__)
  if constexpr (kWord == 16) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (kWord == 8) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + i);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else if constexpr (kWord == 4) {
#pragma unroll
    for (int i = 0; i < kBytes / 4; ++i) w[i] = __ldg(reinterpret_cast<const unsigned int*>(p) + i);
  } else {
#pragma unroll
    for (int i = 0; i < words_for_bytes(kBytes); ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < kBytes / kWord; ++i) {
      const uint32_t v = kWord == 2
                             ? uint32_t(__ldg(reinterpret_cast<const unsigned short*>(p) + i))
                             : uint32_t(__ldg(p + i));
      w[i * kWord / 4] |= v << (8 * ((i * kWord) % 4));
    }
  }
#else
  host_replay_check_alignment(p, kWord);
  for (int i = 0; i < words_for_bytes(kBytes); ++i) w[i] = 0;
  std::memcpy(w, p, kBytes);  // little-endian host
#endif
}

// Writes the first kBytes bytes of the little-endian words w at p, kWord bytes per access.
template <int kBytes, int kWord>
KV_HOST_DEVICE void store_bytes(uint8_t* p, const uint32_t (&w)[words_for_bytes(kBytes)]) {
  static_assert(kWord == 1 || kWord == 2 || kWord == 4 || kWord == 8 || kWord == 16, "word size");
  static_assert(kBytes % kWord == 0, "kBytes must be a multiple of kWord");
#if defined(__CUDA_ARCH__)
  if constexpr (kWord == 16) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      reinterpret_cast<uint4*>(p)[i] =
          make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  } else if constexpr (kWord == 8) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      reinterpret_cast<uint2*>(p)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
    }
  } else if constexpr (kWord == 4) {
#pragma unroll
    for (int i = 0; i < kBytes / 4; ++i) reinterpret_cast<unsigned int*>(p)[i] = w[i];
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / kWord; ++i) {
      const uint32_t v = w[i * kWord / 4] >> (8 * ((i * kWord) % 4));
      if constexpr (kWord == 2) {
        reinterpret_cast<unsigned short*>(p)[i] = static_cast<unsigned short>(v);
      } else {
        p[i] = static_cast<uint8_t>(v);
      }
    }
  }
#else
  host_replay_check_alignment(p, kWord);
  std::memcpy(p, w, kBytes);
#endif
}

// ---------------------------------------------------------------------------------------------
// Source element types: size and exact widening of element i of a word array to fp32.

template <SourceType S>
struct SourceOps;

template <>
struct SourceOps<SourceType::kFloat32> {
  static constexpr SourceType kType = SourceType::kFloat32;
  static constexpr int kSize = 4;
  template <int N>
  static KV_HOST_DEVICE float element(const uint32_t (&w)[N], int i) {
    return bits_as_float(w[i]);
  }
};

template <>
struct SourceOps<SourceType::kBFloat16> {
  static constexpr SourceType kType = SourceType::kBFloat16;
  static constexpr int kSize = 2;
  template <int N>
  static KV_HOST_DEVICE float element(const uint32_t (&w)[N], int i) {
    return bf16_bits_to_float(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
  }
};

template <>
struct SourceOps<SourceType::kFloat16> {
  static constexpr SourceType kType = SourceType::kFloat16;
  static constexpr int kSize = 2;
  template <int N>
  static KV_HOST_DEVICE float element(const uint32_t (&w)[N], int i) {
    const uint16_t h = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
#if defined(__CUDA_ARCH__)
    // The hardware widening is exact for every finite value and ±Inf. NaN payload/sign may
    // differ from fp16_bits_to_float, which no output byte depends on (NaN -> 0x7F / NaN group).
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(h)));
    return f;
#else
    return fp16_bits_to_float(h);
#endif
  }
};

// An unquantized cache of float type C written from source type S != C: the source side is
// SourceOps<S> (load sizes), each element goes through cast_element<S, C>, the software widening
// and rounding of the CPU kernels, so the bytes are theirs on every input, NaN included.
template <SourceType S, SourceType C>
struct CastOps : SourceOps<S> {
  static constexpr SourceType kSource = S;
  static constexpr SourceType kCache = C;
  static constexpr int kCacheSize = C == SourceType::kFloat32 ? 4 : 2;
};

template <typename Src>
inline constexpr bool kIsCast = false;
template <SourceType S, SourceType C>
inline constexpr bool kIsCast<CastOps<S, C>> = true;

}  // namespace vllm_kv::gpu
