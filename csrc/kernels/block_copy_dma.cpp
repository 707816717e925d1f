// Copy-engine (DMA) submission of block copies. Torch-free host code.
#include <vector>

#include "block_copy_cuda.h"
#include "kvcopy/id_runs.h"

namespace kvcopy {
namespace {

struct DmaCopies {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  void add(const uint8_t* src, uint8_t* dst, int64_t nbytes) {
    srcs.push_back(src);
    dsts.push_back(dst);
    sizes.push_back(static_cast<size_t>(nbytes));
  }
};

// One copy per run on dense planes, one per block on strided planes.
DmaCopies plan_copies(const PlaneCopy* planes, int64_t num_planes, const std::vector<IdRun>& runs) {
  DmaCopies copies;
  for (int64_t p = 0; p < num_planes; ++p) {
    const PlaneCopy& plane = planes[p];
    for (const IdRun& run : runs) {
      if (plane_is_dense(plane)) {
        copies.add(plane.src + run.src_id * plane.src_stride,
                   plane.dst + run.dst_id * plane.dst_stride, run.length * plane.nbytes);
        continue;
      }
      for (int64_t k = 0; k < run.length; ++k) {
        copies.add(plane.src + (run.src_id + k) * plane.src_stride,
                   plane.dst + (run.dst_id + k) * plane.dst_stride, plane.nbytes);
      }
    }
  }
  return copies;
}

cudaError_t submit_one_by_one(DmaCopies& copies, cudaStream_t stream) {
  for (size_t i = 0; i < copies.sizes.size(); ++i) {
    cudaError_t err =
        cudaMemcpyAsync(copies.dsts[i], copies.srcs[i], copies.sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The batched call refuses the legacy default stream (handle 0).
bool can_batch(cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  return stream != nullptr && stream != cudaStreamLegacy;
#else
  (void)stream;
  return false;
#endif
}

cudaError_t submit_batched(DmaCopies& copies, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  // Sources are read in stream order: they may be written by earlier work.
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attrs_index = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(copies.dsts.data(), copies.srcs.data(), copies.sizes.data(),
                              copies.sizes.size(), &attrs, &attrs_index, 1, stream);
#else
  size_t fail_index = 0;
  return cudaMemcpyBatchAsync(copies.dsts.data(), const_cast<void**>(copies.srcs.data()),
                              copies.sizes.data(), copies.sizes.size(), &attrs, &attrs_index, 1,
                              &fail_index, stream);
#endif
#else
  return submit_one_by_one(copies, stream);
#endif
}

}  // namespace

cudaError_t submit_block_copy_dma(const PlaneCopy* planes, int64_t num_planes,
                                  const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids,
                                  cudaStream_t stream) {
  if (num_ids <= 0 || num_planes <= 0) return cudaSuccess;
  DmaCopies copies = plan_copies(planes, num_planes, find_id_runs(src_ids, dst_ids, num_ids));
  if (copies.sizes.size() > 1 && can_batch(stream)) return submit_batched(copies, stream);
  return submit_one_by_one(copies, stream);
}

}  // namespace kvcopy
