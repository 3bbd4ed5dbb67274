// Random reshape_and_cache_flash problems for the torch-free checks of the CUDA kernels: host
// images of the source tensors, the cache (random initial bytes, so that untouched bytes are
// checked too; key sink rows, when a problem has them, inside the K pages) and the slot mapping,
// plus the bytes a plain scalar reference writes for the same problem. Shared by
// check_reshape_and_cache_flash_replay.cu (host replay of the kernels) and
// gpu_check_reshape_and_cache_flash.cu (the kernels on a GPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_kernels.h"
#include "dispatch_utils.h"
#include "int4_per_token_head.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::test {

// Element j of a widened row, callable from the __host__ __device__ row quantizer (under nvcc a
// host lambda is not).
struct FloatRow {
  const float* values;
  KV_HOST_DEVICE float operator()(int j) const { return values[j]; }
};

// An fp32 rounded to the source dtype and widened back (int4_per_token_head's rotated rows), as
// the __host__ __device__ row quantizer takes it.
struct RoundToSource {
  SourceType source;
  KV_HOST_DEVICE float operator()(float v) const {
    if (source == SourceType::kBFloat16) return bf16_bits_to_float(vllm_kv::float_to_bf16_bits(v));
    if (source == SourceType::kFloat16) return fp16_bits_to_float(vllm_kv::float_to_fp16_bits(v));
    return v;
  }
};

// A byte buffer whose data() is 64-byte aligned (device allocations are at least 256-byte
// aligned, so offsets from data() give the same alignment on both sides).
class Bytes {
 public:
  Bytes() = default;
  explicit Bytes(size_t size) : storage_(size + 64), size_(size) {}
  uint8_t* data() {
    const uintptr_t a = reinterpret_cast<uintptr_t>(storage_.data());
    return storage_.data() + ((64 - a % 64) % 64);
  }
  const uint8_t* data() const { return const_cast<Bytes*>(this)->data(); }
  size_t size() const { return size_; }

 private:
  std::vector<uint8_t> storage_;
  size_t size_ = 0;
};

struct Shape {
  SourceType source = SourceType::kBFloat16;
  SourceType cache = SourceType::kBFloat16;  // element type of an unquantized cache
  CacheKind kind = CacheKind::kUnquantized;
  int num_heads = 1, head_k = 16, head_v = 16, block_size = 16, num_blocks = 1;
  int tokens = 0, tokens_padded = 0;
  bool hnd = false, fused = true, per_head = false, interleave4_k = false, interleave4_v = false;
  Nvfp4ScalePolicy scale_policy = Nvfp4ScalePolicy::kNearest;  // kNvfp4 only
  int sink_rows = 0;      // key sink rows per page (S; 0: none), after each K page's rows
  bool sink_hnd = false;  // sink rows in [H][S][D] order instead of [S][H][D]
};

// One side's cache placement inside the cache image.
struct SidePlacement {
  int64_t offset = 0;                                           // bytes from the image start
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;  // cache elements
};

inline uint16_t float_to_bf16_bits(float f) { return uint16_t(float_as_bits(f) >> 16); }

inline uint16_t float_to_fp16_bits(float f) {  // truncating; only used to make test data
  const uint32_t b = float_as_bits(f);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = int((b >> 23) & 0xFF) - 127 + 15;
  const uint32_t man = (b >> 13) & 0x3FFu;
  if (((b >> 23) & 0xFF) == 0xFF) return uint16_t(sign | 0x7C00u | (man ? 0x200u : 0u));
  if (exp >= 31) return uint16_t(sign | 0x7BFFu);
  if (exp <= 0) return uint16_t(sign | (exp > -10 ? ((man | 0x400u) >> (1 - exp)) : 0u));
  return uint16_t(sign | (uint32_t(exp) << 10) | man);
}

// Mostly normal values over a wide range, with NaN, ±Inf, ±0 and subnormals mixed in.
inline float random_float(std::mt19937_64& rng) {
  const int pick = int(rng() % 200);
  if (pick == 0) return bits_as_float(0x7FC00000u | uint32_t(rng() % 0x3FFFFF));
  if (pick == 1) return -bits_as_float(0x7F800000u);
  if (pick == 2) return bits_as_float(0x7F800000u);
  if (pick < 6) return (rng() & 1) ? 0.0f : -0.0f;
  if (pick < 8) return bits_as_float(uint32_t(rng() % 0x7FFFFF) | (rng() & 1 ? 0x80000000u : 0u));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return std::ldexp(normal(rng), int(rng() % 25) - 12);
}

inline float random_scale(std::mt19937_64& rng) {
  switch (rng() % 12) {
    case 0:
      return 1.0f;
    case 1:
      return std::ldexp(1.0f, int(rng() % 20) - 10);
    case 2:  // degenerate: the CUDA op does not check scale values; bytes must still match
      return random_float(rng);
    default:
      return std::fabs(std::ldexp(std::normal_distribution<float>(1, 0.5f)(rng), -int(rng() % 8))) +
             1e-6f;
  }
}

struct FlashTestProblem {
  Shape shape;
  int src_size = 2;    // bytes per source element
  int cache_elem = 2;  // bytes per cache element
  Bytes key, value, cache;
  int64_t key_offset = 0, value_offset = 0;  // bytes from the image start to element 0
  int64_t key_stride = 0, value_stride = 0;  // source elements between tokens
  SidePlacement pk, pv;
  SidePlacement sinks;         // key sink rows (shape.sink_rows > 0), strides in bytes
  std::vector<int64_t> slots;  // what the op gets: skips (< 0) and out-of-range slots
  std::vector<float> k_scale, v_scale, sink_scale;
  std::vector<float> k_signs, v_signs;  // int4_per_token_head rotation signs (random ±1)

  std::string describe() const {
    const Shape& p = shape;
    char s[360];
    std::snprintf(
        s, sizeof(s),
        "src=%d cache=%d kind=%d search=%d H=%d D=%d Dv=%d N=%d B=%d T=%d Tpad=%d %s %s "
        "%s il4=%d/%d "
        "key_off=%lld key_stride=%lld page=%lld cache_off=%lld sinks=%d%s",
        int(p.source), int(p.cache), int(p.kind), int(p.scale_policy), p.num_heads, p.head_k,
        p.head_v, p.block_size, p.num_blocks, p.tokens, p.tokens_padded, p.hnd ? "HND" : "NHD",
        p.fused ? "fused" : "split", p.per_head ? "per-head" : "per-tensor", int(p.interleave4_k),
        int(p.interleave4_v), (long long)key_offset, (long long)key_stride,
        (long long)pk.block_stride, (long long)pk.offset, p.sink_rows, p.sink_hnd ? " HND" : "");
    return s;
  }

  // Parameters addressing the given images (host or device copies of key / value / cache / slots
  // / scales, with the same layout as this problem's host images).
  ReshapeAndCacheParams params(uint8_t* cache_image, const uint8_t* key_image,
                               const uint8_t* value_image, const int64_t* slot_mapping,
                               const float* k_scale_ptr, const float* v_scale_ptr,
                               const float* sink_scale_ptr, const float* k_signs_ptr,
                               const float* v_signs_ptr) const {
    const auto side = [&](const SidePlacement& pl, int head_size, const float* scale, bool il4,
                          const float* signs) {
      CacheSide s{};
      s.data = cache_image + pl.offset;
      s.block_stride = pl.block_stride;
      s.token_stride = pl.token_stride;
      s.head_stride = pl.head_stride;
      s.head_size = head_size;
      s.scale = scale;
      s.scale_per_head = shape.per_head;
      s.scale_layout = il4 ? ScaleLayout::kInterleave4 : ScaleLayout::kLinear;
      s.rht_signs = signs;
      return s;
    };
    ReshapeAndCacheParams p{};
    p.key = key_image + key_offset;
    p.value = value_image + value_offset;
    p.key_token_stride = key_stride;
    p.value_token_stride = value_stride;
    p.slot_mapping = slot_mapping;
    p.num_tokens = shape.tokens;
    p.num_blocks = shape.num_blocks;
    p.block_size = shape.block_size;
    p.num_heads = shape.num_heads;
    p.source_type = shape.source;
    p.cache_type = shape.cache;
    p.cache_kind = shape.kind;
    p.nvfp4_scale_policy = shape.scale_policy;
    p.key_cache = side(pk, shape.head_k, k_scale_ptr, shape.interleave4_k, k_signs_ptr);
    p.value_cache = side(pv, shape.head_v, v_scale_ptr, shape.interleave4_v, v_signs_ptr);
    if (shape.sink_rows > 0) {
      KeySinkRows& r = p.key_sinks;
      r.data = cache_image + sinks.offset;
      r.block_stride = sinks.block_stride;
      r.token_stride = sinks.token_stride;
      r.head_stride = sinks.head_stride;
      r.rows = shape.sink_rows;
      r.scale = sink_scale_ptr;
      r.scale_per_head = shape.per_head;
    }
    return p;
  }

  // The cache image after the problem is written, computed independently of the kernels: plain
  // loops over tokens, heads and elements, the scalar quantization of kv_quant_math.h, and cache
  // addresses from the page layout of docs/design.md §5 (NHD / HND, [data | scales] regions,
  // interleave4 formula) rather than from strides or cache_layout.h. Out-of-range slots skip.
  Bytes expected() const {
    Bytes out(cache.size());
    std::memcpy(out.data(), cache.data(), cache.size());
    const Shape& p = shape;
    const int num_slots = p.num_blocks * p.block_size;
    const auto source = [&](const Bytes& image, int64_t offset, int64_t stride, int64_t token,
                            int64_t index) {
      const uint8_t* at = image.data() + offset + (token * stride + index) * src_size;
      if (p.source == SourceType::kFloat32) {
        float f;
        std::memcpy(&f, at, 4);
        return f;
      }
      uint16_t h;
      std::memcpy(&h, at, 2);
      return p.source == SourceType::kBFloat16 ? bf16_bits_to_float(h) : fp16_bits_to_float(h);
    };
    for (int64_t i = 0; i < p.tokens; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0 || slot >= num_slots) continue;
      const int64_t block = slot / p.block_size;
      const int64_t r = slot % p.block_size;
      for (int h = 0; r < p.sink_rows && h < p.num_heads; ++h) {  // e4m3(x / scale)
        uint8_t* row = out.data() + sinks.offset + block * sinks.block_stride +
                       r * sinks.token_stride + h * sinks.head_stride;
        for (int j = 0; j < p.head_k; ++j) {
          const float x = source(key, key_offset, key_stride, i, int64_t(h) * p.head_k + j);
          row[j] = float_to_e4m3_satfinite(x / sink_scale[p.per_head ? h : 0]);
        }
      }
      for (int side = 0; side < 2; ++side) {
        const SidePlacement& pl = side == 0 ? pk : pv;
        const int d = side == 0 ? p.head_k : p.head_v;
        const Bytes& image = side == 0 ? key : value;
        const int64_t off = side == 0 ? key_offset : value_offset;
        const int64_t stride = side == 0 ? key_stride : value_stride;
        const std::vector<float>& scales = side == 0 ? k_scale : v_scale;
        const std::vector<float>& signs = side == 0 ? k_signs : v_signs;
        const bool il4 = side == 0 ? p.interleave4_k : p.interleave4_v;
        uint8_t* page = out.data() + pl.offset + block * pl.block_stride * cache_elem;
        for (int h = 0; h < p.num_heads; ++h) {
          const int64_t entry = p.hnd ? int64_t(h) * p.block_size + r : r * p.num_heads + h;
          const float scale = scales[p.per_head ? h : 0];
          if (p.kind == CacheKind::kUnquantized && p.cache == p.source) {
            std::memcpy(page + entry * d * cache_elem,
                        image.data() + off + (i * stride + int64_t(h) * d) * src_size,
                        size_t(d) * src_size);
          } else if (p.kind == CacheKind::kUnquantized) {  // widened, rounded to nearest even
            for (int j = 0; j < d; ++j) {
              const float x = source(image, off, stride, i, int64_t(h) * d + j);
              uint8_t* at = page + (entry * d + j) * cache_elem;
              if (p.cache == SourceType::kFloat32) {
                std::memcpy(at, &x, 4);
              } else {
                const uint16_t bits = p.cache == SourceType::kBFloat16
                                          ? vllm_kv::float_to_bf16_bits(x)
                                          : vllm_kv::float_to_fp16_bits(x);
                std::memcpy(at, &bits, 2);
              }
            }
          } else if (p.kind == CacheKind::kNvfp4) {
            const int groups = d / kNvfp4GroupSize;
            const float inv = 1.0f / scale;
            for (int g = 0; g < groups; ++g) {
              float x[kNvfp4GroupSize];
              for (int j = 0; j < kNvfp4GroupSize; ++j) {
                x[j] = source(image, off, stride, i, int64_t(h) * d + g * kNvfp4GroupSize + j);
              }
              uint8_t packed[kNvfp4GroupSize / 2];
              const uint8_t sf = nvfp4_policy_quantize_group(p.scale_policy, x, inv, packed);
              std::memcpy(page + entry * (d / 2) + g * 8, packed, 8);
              int64_t row = r, col = g;
              if (il4) {
                const int quarter = groups / 4;
                row = (r / 4) * 4 + g / quarter;
                col = (g % quarter) * 4 + r % 4;
              }
              const int64_t scale_entry =
                  p.hnd ? int64_t(h) * p.block_size + row : row * p.num_heads + h;
              page[int64_t(p.block_size) * p.num_heads * (d / 2) + scale_entry * groups + col] = sf;
            }
          } else if (p.kind == CacheKind::kInt4PerTokenHead) {
            // Rows of d / 2 code bytes plus the scale word; the row arithmetic is the writers'
            // shared one (checked against the torch codec by the CPU op's tests).
            std::vector<float> widened(d);
            for (int j = 0; j < d; ++j) {
              widened[j] = source(image, off, stride, i, int64_t(h) * d + j);
            }
            std::vector<float> scratch(d);
            quantize_int4_per_token_head_row(FloatRow{widened.data()}, RoundToSource{p.source},
                                             signs.data(), d, scratch.data(),
                                             page + entry * int4_row_bytes(d));
          } else if (is_per_token_head(p.kind)) {
            // Rows of d bytes plus the fp32 scale (entry * (d + 4)); the row arithmetic is the
            // writers' shared quantize_per_token_head_row, checked against the torch codec by
            // the CPU op's tests: this replay checks the CUDA decomposition and addressing.
            std::vector<float> widened(d);
            for (int j = 0; j < d; ++j) {
              widened[j] = source(image, off, stride, i, int64_t(h) * d + j);
            }
            const FloatRow load{widened.data()};
            uint8_t* row = page + entry * (d + kPerTokenHeadScaleBytes);
            if (p.kind == CacheKind::kInt8PerTokenHead) {
              quantize_per_token_head_row<CacheKind::kInt8PerTokenHead>(load, d, row);
            } else {
              quantize_per_token_head_row<CacheKind::kFp8PerTokenHead>(load, d, row);
            }
          } else {
            for (int j = 0; j < d; ++j) {
              const float y = source(image, off, stride, i, int64_t(h) * d + j) / scale;
              page[entry * d + j] = p.kind == CacheKind::kFp8E4M3 ? float_to_e4m3_satfinite(y)
                                                                  : float_to_e5m2_satfinite(y);
            }
          }
        }
      }
    }
    return out;
  }
};

// Lays out the caches and sources of `shape` (misalignments and paddings as given) and fills them.
inline FlashTestProblem build_problem(const Shape& shape, std::mt19937_64& rng, int64_t page_pad,
                                      int64_t cache_base, int64_t v_gap, int64_t key_extra,
                                      int64_t value_extra, int64_t key_misalign,
                                      int64_t value_misalign, bool random_values) {
  FlashTestProblem t;
  t.shape = shape;
  const Shape& p = shape;
  const bool nvfp4 = p.kind == CacheKind::kNvfp4;
  t.src_size = p.source == SourceType::kFloat32 ? 4 : 2;
  t.cache_elem = p.kind != CacheKind::kUnquantized ? 1 : p.cache == SourceType::kFloat32 ? 4 : 2;
  const int elem = t.cache_elem;
  // Tensors are aligned to their element size: misalign by whole elements only.
  cache_base -= cache_base % elem;
  v_gap -= v_gap % elem;
  const auto last_dim = [&](int d) -> int64_t {
    if (p.kind == CacheKind::kInt4PerTokenHead) return int4_row_bytes(d);
    return nvfp4 ? d / 2 + d / 16 : is_per_token_head(p.kind) ? d + kPerTokenHeadScaleBytes : d;
  };
  const int64_t f_k = last_dim(p.head_k), f_v = last_dim(p.head_v);
  const int64_t side_k = int64_t(p.block_size) * p.num_heads * f_k;  // elements per page side
  const int64_t side_v = int64_t(p.block_size) * p.num_heads * f_v;
  const auto strides = [&](SidePlacement& s, int64_t f) {
    s.token_stride = p.hnd ? f : int64_t(p.num_heads) * f;
    s.head_stride = p.hnd ? int64_t(p.block_size) * f : f;
  };
  strides(t.pk, f_k);
  strides(t.pv, f_v);
  // Key sink rows after the K and V rows of a fused page, after the K rows of a split one.
  const int64_t sink_bytes = int64_t(p.sink_rows) * p.num_heads * p.head_k;
  const int64_t sink_elems = (sink_bytes + elem - 1) / elem;
  t.sinks.token_stride = p.sink_hnd ? p.head_k : int64_t(p.num_heads) * p.head_k;
  t.sinks.head_stride = p.sink_hnd ? int64_t(p.sink_rows) * p.head_k : p.head_k;
  int64_t cache_bytes;
  if (p.fused) {  // (B, 2, N, H, F) pages
    const int64_t page = side_k + side_v + sink_elems + page_pad;
    t.pk.block_stride = t.pv.block_stride = page;
    t.pk.offset = cache_base;
    t.pv.offset = cache_base + side_k * elem;
    t.sinks.offset = t.pv.offset + side_v * elem;
    t.sinks.block_stride = page * elem;
    cache_bytes = cache_base + page * p.num_blocks * elem + 64;
  } else {
    t.pk.block_stride = side_k + sink_elems + page_pad;
    t.sinks.offset = cache_base + side_k * elem;
    t.sinks.block_stride = t.pk.block_stride * elem;
    t.pv.block_stride = side_v + page_pad;
    t.pk.offset = cache_base;
    t.pv.offset = cache_base + t.pk.block_stride * p.num_blocks * elem + v_gap;
    cache_bytes = t.pv.offset + t.pv.block_stride * p.num_blocks * elem + 64;
  }
  t.cache = Bytes(cache_bytes);
  if (random_values) {
    for (size_t i = 0; i < t.cache.size(); ++i) t.cache.data()[i] = uint8_t(rng());
  } else {  // large benchmark problems: cheap filling
    std::memset(t.cache.data(), 0x5A, t.cache.size());
  }

  t.key_stride = int64_t(p.num_heads) * p.head_k + key_extra;
  t.value_stride = int64_t(p.num_heads) * p.head_v + value_extra;
  t.key_offset = key_misalign * t.src_size;
  t.value_offset = value_misalign * t.src_size;
  const int64_t rows = std::max(1, p.tokens_padded);
  t.key = Bytes(t.key_offset + t.key_stride * rows * t.src_size + 16);
  t.value = Bytes(t.value_offset + t.value_stride * rows * t.src_size + 16);
  std::vector<float> normals(4093);  // cycled through for large benchmark problems
  for (float& f : normals) f = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  const auto fill = [&](Bytes& b) {
    size_t n = 0;
    for (size_t i = 0; i + t.src_size <= b.size(); i += t.src_size, ++n) {
      const float f = random_values ? random_float(rng) : normals[n % normals.size()];
      if (p.source == SourceType::kFloat32) {
        std::memcpy(b.data() + i, &f, 4);
      } else {
        const uint16_t h =
            p.source == SourceType::kBFloat16 ? float_to_bf16_bits(f) : float_to_fp16_bits(f);
        std::memcpy(b.data() + i, &h, 2);
      }
    }
  };
  fill(t.key);
  fill(t.value);

  t.k_scale.resize(p.per_head ? p.num_heads : 1);
  t.v_scale.resize(t.k_scale.size());
  for (auto& s : t.k_scale) s = random_values ? random_scale(rng) : 0.05f;
  for (auto& s : t.v_scale) s = random_values ? random_scale(rng) : 0.05f;
  t.sink_scale.resize(t.k_scale.size());
  for (auto& s : t.sink_scale) s = random_values ? random_scale(rng) : 0.05f;
  for (auto [signs, d] : {std::pair{&t.k_signs, p.head_k}, std::pair{&t.v_signs, p.head_v}}) {
    signs->resize(size_t(int4_rht_block(d)));
    for (auto& s : *signs) s = rng() % 2 ? 1.0f : -1.0f;
  }
  return t;
}

// A random problem: dtypes, head sizes, layouts, paddings, strides, misalignments, slots.
inline FlashTestProblem make_random_problem(std::mt19937_64& rng) {
  Shape p;
  p.source = SourceType(rng() % 3);
  p.kind = CacheKind(rng() % 7);
  // Unquantized: half the problems cast to another float type.
  p.cache = p.kind == CacheKind::kUnquantized && rng() % 2 ? SourceType(rng() % 3) : p.source;
  const bool nvfp4 = p.kind == CacheKind::kNvfp4;
  p.scale_policy = nvfp4 ? Nvfp4ScalePolicy(rng() % 3) : Nvfp4ScalePolicy::kNearest;
  const bool per_token_head = is_per_token_head(p.kind);
  p.num_heads = 1 + int(rng() % 5);
  static const int kBlockSizes[] = {1, 2, 3, 4, 8, 16};
  p.block_size = kBlockSizes[rng() % 6];
  p.num_blocks = 1 + int(rng() % 6);
  if (nvfp4) {
    static const int kNvfp4Heads[] = {16, 32, 48, 64, 128, 192, 256};
    p.head_k = kNvfp4Heads[rng() % 7];
    p.head_v = rng() % 2 ? p.head_k : kNvfp4Heads[rng() % 7];
  } else {
    p.head_k = 1 + int(rng() % 160);
    p.head_v = rng() % 2 ? p.head_k : 1 + int(rng() % 160);
    if (rng() % 2) p.head_k = p.head_v = 16 * (1 + int(rng() % 16));  // the aligned common case
    if (rng() % 4 == 0) p.head_v = 8 * (1 + int(rng() % 32));
    if (per_token_head) {  // multiples of 4 (the scale stays 4-byte aligned in the tensor)
      p.head_k = 4 * ((p.head_k + 3) / 4);
      p.head_v = 4 * ((p.head_v + 3) / 4);
    }
    if (p.kind == CacheKind::kInt4PerTokenHead) {  // D / 2 + 4 bytes: D a multiple of 8
      p.head_k = 8 * ((p.head_k + 7) / 8);
      p.head_v = 8 * ((p.head_v + 7) / 8);
    }
  }
  p.hnd = rng() % 2;
  p.fused = p.head_k == p.head_v && rng() % 2;
  p.per_head = rng() % 2;
  p.interleave4_k = nvfp4 && p.block_size % 4 == 0 && (p.head_k / 16) % 4 == 0 && rng() % 2;
  p.interleave4_v = nvfp4 && p.block_size % 4 == 0 && (p.head_v / 16) % 4 == 0 && rng() % 2;
  p.sink_rows = rng() % 3 == 0 ? 1 + int(rng() % p.block_size) : 0;
  p.sink_hnd = p.sink_rows > 0 && rng() % 2;
  const int num_slots = p.num_blocks * p.block_size;
  p.tokens = int(rng() % (num_slots + 6));
  p.tokens_padded = p.tokens + int(rng() % 3);

  const int64_t page_pad =
      rng() % 3 == 0 ? (rng() % 2 ? 16 * int64_t(rng() % 4) : int64_t(rng() % 40)) : 0;
  const int64_t cache_base = rng() % 6 == 0 ? int64_t(rng() % 16) : 0;
  const int64_t v_gap = rng() % 4 == 0 ? int64_t(rng() % 8) : 0;
  const int64_t key_extra = rng() % 4 == 0 ? int64_t(rng() % 9) : 0;
  const int64_t value_extra = rng() % 4 == 0 ? int64_t(rng() % 9) : 0;
  const int64_t key_misalign = rng() % 6 == 0 ? int64_t(rng() % 4) : 0;
  const int64_t value_misalign = rng() % 6 == 0 ? int64_t(rng() % 4) : 0;
  FlashTestProblem t = build_problem(p, rng, page_pad, cache_base, v_gap, key_extra, value_extra,
                                     key_misalign, value_misalign, /*random_values=*/true);

  // Distinct valid slots, some skipped (negative), some out of range (the GPU skips them).
  std::vector<int64_t> perm(num_slots);
  for (int i = 0; i < num_slots; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  t.slots.assign(std::max(1, p.tokens), -1);
  for (int i = 0; i < p.tokens; ++i) {
    const int pick = int(rng() % 10);
    int64_t s = i < num_slots ? perm[i] : -1;
    if (pick == 0) s = -1 - int64_t(rng() % 3);
    if (pick == 1) s = num_slots + int64_t(rng() % 5);
    if (pick == 2) s = int64_t(1) << 40;
    t.slots[i] = s;
  }
  return t;
}

// A dense, aligned problem as a serving engine writes it: `tokens` new tokens into consecutive
// slots of an NHD or HND cache with room for all of them.
inline FlashTestProblem make_dense_problem(
    SourceType source, CacheKind kind, int tokens, int num_heads, int head_size, int block_size,
    bool hnd, std::mt19937_64& rng, Nvfp4ScalePolicy scale_policy = Nvfp4ScalePolicy::kNearest) {
  Shape p;
  p.source = source;
  p.cache = source;
  p.kind = kind;
  p.scale_policy = scale_policy;
  p.num_heads = num_heads;
  p.head_k = p.head_v = head_size;
  p.block_size = block_size;
  p.num_blocks = (tokens + block_size - 1) / block_size + 1;
  p.tokens = p.tokens_padded = tokens;
  p.hnd = hnd;
  p.fused = true;
  FlashTestProblem t = build_problem(p, rng, 0, 0, 0, 0, 0, 0, 0, /*random_values=*/false);
  t.slots.resize(std::max(1, tokens));
  for (int i = 0; i < tokens; ++i) t.slots[i] = i;
  return t;
}

}  // namespace vllm_kv::test
