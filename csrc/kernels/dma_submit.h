// Submitting planned byte ranges to the copy engines (dma_submit.cpp), shared
// by the DMA copy (copy_blocks_dma.cpp) and the benchmark baselines. Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kvcopy/copy_ranges.h"

namespace kvcopy {

// Splits `ranges` at registration chunks and submits them on `stream`: with
// `batched`, one cudaMemcpyBatchAsync where the runtime has it (CUDA 12.8+),
// else one cudaMemcpyAsync per range. The current device is the stream's.
cudaError_t submit_copy_ranges(const std::vector<CopyRange>& ranges, bool batched, cudaStream_t stream);

// Side streams the batched submission holds for host threads that submitted on the legacy default
// stream (one per thread and device, destroyed when the thread exits). For tests.
int64_t dma_side_streams_alive();

}  // namespace kvcopy
