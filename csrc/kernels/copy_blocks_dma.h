// The DMA copy: block copies submitted to the copy engines (copy_blocks_dma.cpp).
// Torch-free: raw pointers, int64 sizes, cudaStream_t in, cudaError_t out.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

// Copy-engine path: the byte ranges of kvcopy/copy_ranges.h (adjacent runs
// and side-by-side planes merged), all submitted with one cudaMemcpyBatchAsync
// (CUDA 12.8+; on the legacy default stream through an event-ordered side
// stream), else one cudaMemcpyAsync per range. `src_ids`/`dst_ids` are host
// pointers, validated by the caller; the current device is the stream's.
cudaError_t copy_blocks_dma(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                            int64_t num_ids, cudaStream_t stream);

}  // namespace kvcopy
