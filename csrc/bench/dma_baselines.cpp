// Benchmark baselines for the copy-engine path (dma_baselines.h). Torch-free host code.
#include "dma_baselines.h"

#include <vector>

#include "kernels/dma_submit.h"

namespace kvcopy {
namespace {

// One range per (block, plane), nothing merged: what a caller without
// kvcopy's range planner submits.
std::vector<CopyRange> block_by_block_ranges(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                             const int64_t* dst_ids, int64_t num_ids) {
  std::vector<CopyRange> ranges;
  ranges.reserve(static_cast<size_t>(num_ids * num_planes));
  for (int64_t i = 0; i < num_ids; ++i) {
    for (int64_t p = 0; p < num_planes; ++p) {
      const PlaneCopy& plane = planes[p];
      ranges.push_back(
          {plane.src + src_ids[i] * plane.src_stride, plane.dst + dst_ids[i] * plane.dst_stride, plane.nbytes});
    }
  }
  return ranges;
}

}  // namespace

cudaError_t copy_blocks_dma_baseline(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                     const int64_t* dst_ids, int64_t num_ids, DmaBaseline baseline,
                                     cudaStream_t stream) {
  if (num_ids <= 0 || num_planes <= 0) return cudaSuccess;
  return submit_copy_ranges(block_by_block_ranges(planes, num_planes, src_ids, dst_ids, num_ids),
                            /*batched=*/baseline == DmaBaseline::kUnmergedBatch, stream);
}

}  // namespace kvcopy
