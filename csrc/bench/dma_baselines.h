// Benchmark baselines for the copy-engine path (not used by kvcopy's copies):
// the same block copies with nothing merged, one range per (block, plane),
// submitted either as one cudaMemcpyBatchAsync (the batched call without
// kvcopy's coalescing) or as one cudaMemcpyAsync each (vLLM's old
// swap_blocks). Built into the benchmark's module (baselines_module.cpp), not
// into kvcopy._C. Torch-free; same pointer contract as copy_blocks_dma.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

enum class DmaBaseline : int { kPerBlockMemcpy = 0, kUnmergedBatch = 1 };

cudaError_t copy_blocks_dma_baseline(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                     const int64_t* dst_ids, int64_t num_ids, DmaBaseline baseline,
                                     cudaStream_t stream);

}  // namespace kvcopy
