// How an NVFP4 writer chooses each group's block-scale byte. The page bytes are nvfp4's under
// every policy, so readers need not know it; the kv_cache_dtype string names it.
#pragma once

#include <cstdint>

namespace vllm_kv {

enum class Nvfp4ScalePolicy : uint8_t {
  kNearest,  // nvfp4: amax / 6 rounded to e4m3
  kMse,      // nvfp4_mse: the best of sf - 1, sf, sf + 1 (docs/design.md §5.3)
  k4over6,   // nvfp4_4over6: amax / 6 or amax / 4, whichever has the lower squared error
};

}  // namespace vllm_kv
