// The compiled packed-slot stores' validation (TurboQuant, ultraquant_4bit, Octave), shared by the
// CPU ops (cpu/packed_slot_store_cpu.cpp) and the CUDA ops.
#include "packed_slot_ops_torch.h"

#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "cache_ops_checks.h"
#include "cache_ops_torch.h"

namespace vllm_kv {

namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t n, int64_t h, int64_t d) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == n && t.size(1) == h && t.size(2) == d &&
                  (d <= 1 || t.stride(2) == 1),
              name, ": expected a [", n, ", ", h, ", ", d,
              "] tensor with contiguous rows, got shape ", shape_str(t), " and strides ",
              t.strides());
}

void check_table(const std::optional<at::Tensor>& t, const char* name, int64_t numel,
                 const at::Tensor& kv_cache) {
  TORCH_CHECK(t.has_value(), name, ": expected a float32 tensor of ", numel,
              " elements for Lloyd-Max keys, got None");
  check_same_device(*t, name, kv_cache);
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == numel && t->is_contiguous(), name,
              ": expected a contiguous float32 tensor of ", numel, " elements, got ",
              dtype_str(t->scalar_type()), " of shape ", shape_str(*t));
}

// The parts of a packed-slot store that both formats share: devices, value [N, H, D] with D a
// positive multiple of `group`, key rows of value's shape, the cache (num_blocks, block_size, H,
// >= slot_bytes_of(D)) uint8 with contiguous slots, slot_mapping int64 [N]. Fills `a`.
template <typename SlotBytes>
void check_store(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, int64_t group, const SlotBytes& slot_bytes_of,
                 PackedStoreArgs& a) {
  check_same_device(key, "key", kv_cache);
  check_same_device(value, "value", kv_cache);
  check_same_device(slot_mapping, "slot_mapping", kv_cache);
  TORCH_CHECK(value.dim() == 3, "value: expected shape [N, H, D], got ", shape_str(value));
  const int64_t n = value.size(0), h = value.size(1), d = value.size(2);
  TORCH_CHECK(d > 0 && d % group == 0, "value: expected a head dim that is a positive multiple of ",
              group, ", got ", d);
  a.value_type = source_type_of(value, "value");
  check_rows(value, "value", n, h, d);
  check_rows(key, "key", n, h, d);
  const int64_t slot_bytes = slot_bytes_of(d);
  TORCH_CHECK(kv_cache.scalar_type() == at::kByte, "kv_cache: expected dtype uint8, got ",
              dtype_str(kv_cache.scalar_type()));
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(2) == h && kv_cache.size(3) >= slot_bytes &&
                  kv_cache.stride(3) == 1,
              "kv_cache: expected a (num_blocks, block_size, ", h, ", >= ", slot_bytes,
              ") tensor with contiguous slots, got shape ", shape_str(kv_cache), " and strides ",
              kv_cache.strides());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == n && (n <= 1 || slot_mapping.stride(0) == 1),
              "slot_mapping: expected a contiguous int64 [", n, "] tensor, got ",
              dtype_str(slot_mapping.scalar_type()), " of shape ", shape_str(slot_mapping));
  check_int_range(kv_cache.size(1), "kv_cache block_size");
  check_int_range(h, "value heads");
  a.value = value.data_ptr();
  a.key_token_stride = key.stride(0);
  a.key_head_stride = key.stride(1);
  a.value_token_stride = value.stride(0);
  a.value_head_stride = value.stride(1);
  a.cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  a.block_stride = kv_cache.stride(0);
  a.entry_stride = kv_cache.stride(1);
  a.head_stride = kv_cache.stride(2);
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.num_tokens = n;
  a.num_slots = kv_cache.size(0) * kv_cache.size(1);
  a.num_heads = int(h);
  a.head_dim = int(d);
  a.block_size = int(kv_cache.size(1));
}

}  // namespace

void check_slot_range(const PackedStoreArgs& a) {
  for (const int64_t i : c10::irange(a.num_tokens)) {
    TORCH_CHECK(a.slot_mapping[i] < a.num_slots,
                "slot_mapping: expected slots < num_blocks * block_size = ", a.num_slots,
                " (negative to skip a token), got slot_mapping[", i, "] = ", a.slot_mapping[i]);
  }
}

TurboQuantWriteArgs prepare_turboquant_store(const at::Tensor& key, const at::Tensor& value,
                                             const at::Tensor& kv_cache,
                                             const at::Tensor& slot_mapping,
                                             const std::optional<at::Tensor>& key_norms,
                                             const std::optional<at::Tensor>& midpoints,
                                             int64_t key_bits, int64_t value_bits) {
  TORCH_CHECK(key_bits == 3 || key_bits == 4 || key_bits == kTurboQuantFp8KeyBits,
              "key_bits: expected 3, 4 or ", kTurboQuantFp8KeyBits, " (FP8 keys), got ", key_bits);
  TORCH_CHECK(value_bits == 3 || value_bits == 4, "value_bits: expected 3 or 4, got ", value_bits);
  TurboQuantWriteArgs a{};
  a.key_bits = int(key_bits);
  a.value_bits = int(value_bits);
  check_store(
      key, value, kv_cache, slot_mapping, kTurboQuantCodeGroup,
      [&](int64_t d) {
        return turboquant_key_bytes(int(d), a.key_bits) + d * a.value_bits / 8 + 4;
      },
      a);
  if (a.key_bits == kTurboQuantFp8KeyBits) {
    TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key: expected dtype ",
                dtype_str(value.scalar_type()), " (value's) for FP8 keys, got ",
                dtype_str(key.scalar_type()));
  } else {
    TORCH_CHECK(key.scalar_type() == at::kFloat, "key: expected dtype float32 (the rotated unit ",
                "keys) for ", key_bits, "-bit keys, got ", dtype_str(key.scalar_type()));
    check_table(key_norms, "key_norms", a.num_tokens * a.num_heads, kv_cache);
    check_table(midpoints, "midpoints", (int64_t(1) << key_bits) - 1, kv_cache);
    a.key_norms = key_norms->data_ptr<float>();
    a.midpoints = midpoints->data_ptr<float>();
  }
  a.key = key.data_ptr();
  return a;
}

UltraQuantWriteArgs prepare_ultraquant_store(const at::Tensor& key, const at::Tensor& value,
                                             const at::Tensor& kv_cache,
                                             const at::Tensor& slot_mapping, double constant_c) {
  TORCH_CHECK(std::isfinite(constant_c) && constant_c > 0.0,
              "constant_c: expected a finite value > 0, got ", constant_c);
  UltraQuantWriteArgs a{};
  a.constant_c = float(constant_c);
  check_store(
      key, value, kv_cache, slot_mapping, kUltraQuantGroup,
      [](int64_t d) { return d + 2 * (d / kUltraQuantGroup); }, a);
  TORCH_CHECK(key.scalar_type() == at::kFloat, "key: expected dtype float32 (the rotated keys), ",
              "got ", dtype_str(key.scalar_type()));
  a.key = key.data_ptr<float>();
  return a;
}

namespace {

void check_signs(const at::Tensor& t, const char* name, int64_t d, const at::Tensor& cache) {
  check_same_device(t, name, cache);
  TORCH_CHECK(
      t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == d / 32 && t.is_contiguous(), name,
      ": expected a contiguous int32 [", d / 32,
      "] tensor (octave_codec.sign_bits(head dim)), got ", dtype_str(t.scalar_type()), " of shape ",
      shape_str(t));
}

}  // namespace

OctaveWriteArgs prepare_octave_store(const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& cache, const at::Tensor& slot_mapping,
                                     const at::Tensor& k_signs, const at::Tensor& v_signs,
                                     int64_t fmt) {
  const int64_t value_bits = fmt & ~int64_t(kOctaveCompactFlag);
  TORCH_CHECK(value_bits == 3 || value_bits == 4,
              "fmt: expected 3 or 4 (block K, V bits), or 19 (compact K), got ", fmt);
  OctaveWriteArgs a{};
  a.value_bits = int(value_bits);
  a.compact = (fmt & kOctaveCompactFlag) != 0;
  TORCH_CHECK(value.dim() == 3, "value: expected shape [N, H, D], got ", shape_str(value));
  const int64_t h = value.size(1), d = value.size(2);
  TORCH_CHECK(d > 0 && d % kOctaveBlock == 0 && d <= kOctaveMaxHeadDim &&
                  (!a.compact || (d & (d - 1)) == 0),
              "value: expected a head dim that is a multiple of ", kOctaveBlock, " up to ",
              kOctaveMaxHeadDim, a.compact ? " and a power of two (compact K)" : "", ", got ", d);
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.size(1) == h,
              "cache: expected a uint8 (num_blocks, ", h, ", block_size, slot bytes) tensor, got ",
              dtype_str(cache.scalar_type()), " of shape ", shape_str(cache));
  // Block K's slot grows by 8 bytes per 64 rotary dims: its size names them.
  const int slot = int(cache.size(3));
  a.rope_dim = -1;
  std::string sizes;
  for (int r = 0; r <= (a.compact ? 0 : d); r += kOctaveBlock) {
    const int bytes = octave_slot_bytes(int(d), r, a.value_bits, a.compact);
    sizes += (sizes.empty() ? "" : ", ") + std::to_string(bytes);
    if (bytes == slot && a.rope_dim < 0) a.rope_dim = r;
  }
  TORCH_CHECK(a.rope_dim >= 0, "cache: expected slots of ", sizes, " bytes (fmt ", fmt,
              ", head dim ", d, a.compact ? "" : "; 0, 64, ... rotary dims", "), got ", slot);
  TORCH_CHECK(cache.stride(3) == 1, "cache: expected contiguous slots, got strides ",
              cache.strides());
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key: expected dtype ",
              dtype_str(value.scalar_type()), " (value's), got ", dtype_str(key.scalar_type()));
  check_store(
      key, value, cache.transpose(1, 2), slot_mapping, kOctaveBlock,
      [&](int64_t) { return int64_t(slot); }, a);
  check_signs(k_signs, "k_signs", d, cache);
  check_signs(v_signs, "v_signs", d, cache);
  a.key = key.data_ptr();
  a.key_signs = k_signs.data_ptr<int32_t>();
  a.value_signs = v_signs.data_ptr<int32_t>();
  return a;
}

}  // namespace vllm_kv
