// The DMA copy (copy_blocks_dma.h): plans the byte ranges and submits them batched (dma_submit.h).
// Torch-free host code.
#include "copy_blocks_dma.h"

#include "dma_submit.h"
#include "kvcopy/copy_ranges.h"

namespace kvcopy {

cudaError_t copy_blocks_dma(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                            int64_t num_ids, cudaStream_t stream) {
  if (num_ids <= 0 || num_planes <= 0) return cudaSuccess;
  return submit_copy_ranges(plan_copy_ranges(planes, num_planes, src_ids, dst_ids, num_ids), /*batched=*/true, stream);
}

}  // namespace kvcopy
