// Host entry points of the CUDA packed-slot stores (docs/formats.md §6.3, §6.4). Framework-free:
// the torch glue validates the arguments (packed_slot_ops_torch.h), then calls these with the
// current stream. Neither checks its launch: call cudaGetLastError afterwards.
#pragma once

#include <cuda_runtime_api.h>

#include "../octave_slot.h"
#include "../turboquant_slot.h"
#include "../ultraquant_slot.h"

namespace vllm_kv {

// One thread per (token, head) slot (write_turboquant_slot), instantiated for a.value_type. Slots <
// 0 or >= num_slots are skipped on the device; nothing for no slots.
void launch_turboquant_store(const TurboQuantWriteArgs& a, cudaStream_t stream);

// One thread per group of 32 values of a slot's side (write_ultraquant_unit), as above.
void launch_ultraquant_store(const UltraQuantWriteArgs& a, cudaStream_t stream);

// One warp per side (K or V) of a slot (write_octave_side over a warp team, its scratch in shared
// memory), as above.
void launch_octave_store(const OctaveWriteArgs& a, cudaStream_t stream);

}  // namespace vllm_kv
