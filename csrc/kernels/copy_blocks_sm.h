// The SM copy: block copies by a CUDA kernel (copy_blocks_sm.cu).
// Torch-free: raw pointers, int64 sizes, cudaStream_t in, cudaError_t out.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

// Planes passed by value in one launch: 40 B each, so 10 KiB of kernel
// parameters, inside the 32 KiB that CUDA 12.1+ allows on Volta and newer.
// A cache with more planes is copied in several launches on the same stream.
constexpr int64_t kMaxPlanesPerLaunch = 256;

// The plane capacity of the launch that copies `num_planes` planes (<= kMaxPlanesPerLaunch):
// 8, 64 or 256. Host code, for the launch itself and copy_blocks_sm_grid.
int64_t plane_table_capacity(int64_t num_planes);

// The grid the SM kernel would launch with for `num_items` work items (warp-sized chunks) of a
// launch of `num_planes` planes and a CTA budget (<= 0: one wave of resident CTAs), on the
// current device. For tests (kvcopy._C.sm_kernel_grid).
cudaError_t copy_blocks_sm_grid(int64_t num_items, int64_t num_planes, int requested, int* num_ctas);

// SM kernel: every (block, plane) pair, in chunks of at most 32 KiB, is copied
// by one warp with the widest vector accesses (up to 16 B) its alignment allows. `src_ids`/`dst_ids` are device (or
// mapped pinned host) pointers of length num_ids. Ids outside
// [0, src_num_blocks) or [0, dst_num_blocks) are skipped, never dereferenced.
// num_ctas <= 0 sizes the grid to the work, up to one wave of the CTAs that are
// resident at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor x SMs). Each
// launch passes a plane table of the smallest capacity (8, 64, 256) that holds
// its planes. The current device must be the stream's.
cudaError_t copy_blocks_sm(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                           int64_t num_ids, int64_t src_num_blocks, int64_t dst_num_blocks, int num_ctas,
                           cudaStream_t stream);

}  // namespace kvcopy
