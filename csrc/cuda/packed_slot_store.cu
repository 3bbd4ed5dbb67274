// CUDA packed-slot stores: TurboQuant one thread per (token, head) slot, ultraquant_4bit one
// thread per group of 32 values, Octave one warp per side of a slot, running the functions of
// turboquant_slot.h / ultraquant_slot.h / octave_slot.h, so the bytes are the CPU ops' (which run
// the same functions in a loop) and the reference codecs'. Torch-free.
#include "packed_slot_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace vllm_kv {
namespace {

constexpr int kThreads = 128;

// Grid of a grid-stride loop over `total` items.
unsigned grid_for(int64_t total) {
  return unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 1 << 20));
}

template <SourceType KS, SourceType VS>
__global__ void __launch_bounds__(kThreads)
    turboquant_store_kernel(const __grid_constant__ TurboQuantWriteArgs a) {
  const int64_t total = a.num_tokens * a.num_heads;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    write_turboquant_slot<KS, VS>(a, i / a.num_heads, int(i % a.num_heads));
  }
}

template <SourceType VS>
__global__ void __launch_bounds__(kThreads)
    ultraquant_store_kernel(const __grid_constant__ UltraQuantWriteArgs a) {
  const int units = ultraquant_units(a.head_dim);
  const int64_t total = a.num_tokens * a.num_heads * units;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t slot = i / units;
    write_ultraquant_unit<VS>(a, slot / a.num_heads, int(slot % a.num_heads), int(i % units));
  }
}

constexpr int kWarp = 32;
constexpr int kOctaveWarps = kThreads / kWarp;

// The lanes of one warp as an octave_slot.h team: each step's indices strided over the lanes,
// then a warp barrier (the next step reads what other lanes wrote).
struct WarpTeam {
  int lane;
  template <typename Fn>
  __device__ void run(int n, const Fn& fn) const {
    for (int i = lane; i < n; i += kWarp) fn(i);
    __syncwarp();
  }
  template <typename Fn>
  __device__ void run2(int outer, int log2_inner, const Fn& fn) const {
    const int mask = (1 << log2_inner) - 1;
    for (int i = lane; i < (outer << log2_inner); i += kWarp) fn(i >> log2_inner, i & mask);
    __syncwarp();
  }
};

// At least 4 blocks per SM (at most 128 registers a thread): without that bound ptxas spills a few
// registers on sm_80 / sm_90 (its allocation, not a shortage: the kernel uses fewer).
template <SourceType VS>
__global__ void __launch_bounds__(kThreads, 4)
    octave_store_kernel(const __grid_constant__ OctaveWriteArgs a) {
  __shared__ OctaveScratch scratch[kOctaveWarps];
  const int warp = int(threadIdx.x) / kWarp;
  const WarpTeam team{int(threadIdx.x) % kWarp};
  const int64_t total = a.num_tokens * a.num_heads * kOctaveSides;
  const int64_t step = int64_t(gridDim.x) * kOctaveWarps;
  for (int64_t i = int64_t(blockIdx.x) * kOctaveWarps + warp; i < total; i += step) {
    const int64_t slot = i / kOctaveSides;
    write_octave_side<VS>(team, scratch[warp], a, slot / a.num_heads, int(slot % a.num_heads),
                          int(i % kOctaveSides));
  }
}

}  // namespace

void launch_turboquant_store(const TurboQuantWriteArgs& a, cudaStream_t stream) {
  const int64_t total = a.num_tokens * a.num_heads;
  if (total <= 0) return;
  dispatch_turboquant_types(a.key_bits == kTurboQuantFp8KeyBits, a.value_type,
                            [&](auto ks, auto vs) {
                              turboquant_store_kernel<decltype(ks)::value, decltype(vs)::value>
                                  <<<grid_for(total), kThreads, 0, stream>>>(a);
                            });
}

void launch_ultraquant_store(const UltraQuantWriteArgs& a, cudaStream_t stream) {
  const int64_t total = a.num_tokens * a.num_heads * ultraquant_units(a.head_dim);
  if (total <= 0) return;
  dispatch_source_type(a.value_type, [&](auto vs) {
    ultraquant_store_kernel<decltype(vs)::value><<<grid_for(total), kThreads, 0, stream>>>(a);
  });
}

void launch_octave_store(const OctaveWriteArgs& a, cudaStream_t stream) {
  const int64_t units = a.num_tokens * a.num_heads * kOctaveSides;
  if (units <= 0) return;
  const unsigned grid =
      unsigned(std::min<int64_t>((units + kOctaveWarps - 1) / kOctaveWarps, 1 << 20));
  dispatch_source_type(a.value_type, [&](auto vs) {
    octave_store_kernel<decltype(vs)::value><<<grid, kThreads, 0, stream>>>(a);
  });
}

}  // namespace vllm_kv
