// Submitting planned byte ranges to the copy engines (copy_blocks_dma.cpp),
// shared by the production path and the benchmark baselines. Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "kvcopy/copy_ranges.h"

namespace kvcopy {

// Splits `ranges` at registration chunks and submits them on `stream`: with
// `batched`, one cudaMemcpyBatchAsync where the runtime has it (CUDA 12.8+),
// else one cudaMemcpyAsync per range. The current device is the stream's.
cudaError_t submit_copy_ranges(const std::vector<CopyRange>& ranges, bool batched, cudaStream_t stream);

}  // namespace kvcopy
