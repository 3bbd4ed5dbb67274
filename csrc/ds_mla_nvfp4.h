// nvfp4_ds_mla records (docs/formats.md §6.5): DeepSeek-V3.2's MLA latent of 512 NoPE + 64 RoPE
// bf16 values as one 352-byte record per token, written operation for operation as the reference
// codec vllm/kv_quant/ds_mla_nvfp4.py (upstream's CUDA writer's arithmetic). Framework-free;
// host and device. A token's record is 33 units: 32 NoPE groups of 16 values (8 E2M1 bytes and
// one e4m3 block-scale byte each) and the RoPE unit (64 e4m3 bytes). The CUDA kernel runs one
// thread per unit; the CPU op runs the same units in a loop, so it replays the GPU's work exactly.
#pragma once

#include <cstdint>

#include "kv_quant_math.h"

namespace vllm_kv {

constexpr int kDsMlaNopeDim = 512;
constexpr int kDsMlaRopeDim = 64;
constexpr int kDsMlaGroups = kDsMlaNopeDim / kNvfp4GroupSize;        // 32
constexpr int kDsMlaRopeOffset = kDsMlaNopeDim / 2;                  // 256
constexpr int kDsMlaScaleOffset = kDsMlaRopeOffset + kDsMlaRopeDim;  // 320
constexpr int kDsMlaRecordBytes = kDsMlaScaleOffset + kDsMlaGroups;  // 352
constexpr int kDsMlaUnits = kDsMlaGroups + 1;
// Smallest block scale (the smallest e4m3 subnormal): an all-zero group keeps a positive scale.
constexpr float kDsMlaScaleFloor = 1.0f / 512.0f;

// One concat_and_cache_mla call into an nvfp4_ds_mla cache (B, N, 352) uint8.
struct DsMlaWriteArgs {
  const uint16_t* kv_c;  // bf16 bits [T_pad, 512], rows kv_c_stride elements apart
  const uint16_t* k_pe;  // bf16 bits [T_pad, 64], rows k_pe_stride elements apart
  int64_t kv_c_stride;
  int64_t k_pe_stride;
  uint8_t* cache;
  int64_t block_stride;         // bytes between pages
  int64_t entry_stride;         // bytes between a page's records
  const int64_t* slot_mapping;  // [num_tokens]; < 0 or >= num_slots: skipped
  int64_t num_tokens;
  int64_t num_slots;
  int block_size;
};

// Byte (of the 32 scale bytes) of NoPE group g's scale: an 8x4 to 4x8 transpose.
KV_HOST_DEVICE constexpr int ds_mla_scale_byte(int g) { return 8 * (g % 4) + g / 4; }

// Writes unit `unit` (in [0, kDsMlaUnits)) of token `token`'s record.
KV_HOST_DEVICE void write_ds_mla_unit(const DsMlaWriteArgs& a, int64_t token, int unit) {
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;
  uint8_t* record =
      a.cache + (slot / a.block_size) * a.block_stride + (slot % a.block_size) * a.entry_stride;
  if (unit == kDsMlaGroups) {  // RoPE: plain e4m3, no scale
    const uint16_t* pe = a.k_pe + token * a.k_pe_stride;
    for (int i = 0; i < kDsMlaRopeDim; ++i) {
      record[kDsMlaRopeOffset + i] = float_to_e4m3_satfinite(bf16_bits_to_float(pe[i]));
    }
    return;
  }
  const uint16_t* src = a.kv_c + token * a.kv_c_stride + unit * kNvfp4GroupSize;
  float x[kNvfp4GroupSize];
  float amax = 0.0f;
  KV_UNROLL
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    x[i] = bf16_bits_to_float(src[i]);
    amax = fmaxf(amax, fabsf(x[i]));  // a NaN is skipped, as fmaxf does
  }
  const uint8_t sf = float_to_e4m3_satfinite(fmaxf(kv_fdiv(amax, kE2M1Max), kDsMlaScaleFloor));
  const float inv = kv_fdiv(1.0f, e4m3_to_float(sf));
  KV_UNROLL
  for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
    const uint8_t lo = float_to_e2m1(kv_fmul(x[2 * j], inv));
    const uint8_t hi = float_to_e2m1(kv_fmul(x[2 * j + 1], inv));
    record[unit * (kNvfp4GroupSize / 2) + j] = uint8_t(lo | (hi << 4));
  }
  record[kDsMlaScaleOffset + ds_mla_scale_byte(unit)] = sf;
}

}  // namespace vllm_kv
