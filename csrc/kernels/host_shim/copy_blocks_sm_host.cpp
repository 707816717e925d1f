// The SM kernel's own source (copy_blocks_sm.cu) compiled for the CPU, with a C entry point for ctypes.
//
// Built only by tests/core/test_sm_kernel_on_host.py (g++, this folder first on the include path, so that
// <cuda_runtime_api.h> is the stand-in beside this file); setup.py never builds it. Everything from the
// plane-table split to the kernel's index math runs as on a GPU, every thread of every CTA in turn.
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <vector>

#include "kernels/copy_blocks_sm.cu"
#include "kvcopy/plane_table.h"

namespace {

sigjmp_buf fault_return;

void on_fault(int signal) { siglongjmp(fault_return, signal); }

// Runs copy(), turning a SIGSEGV or SIGBUS in it (an access the kernel misaligned or sent out of bounds, a
// fault on a GPU too) into cudaErrorIllegalAddress, as a faulting launch reports, instead of ending the
// process that loaded this library.
template <typename Copy>
int catching_faults(Copy copy) {
  struct sigaction ours{};
  struct sigaction old_segv{};
  struct sigaction old_bus{};
  ours.sa_handler = on_fault;
  sigemptyset(&ours.sa_mask);
  sigaction(SIGSEGV, &ours, &old_segv);
  sigaction(SIGBUS, &ours, &old_bus);
  int result = cudaErrorIllegalAddress;
  if (sigsetjmp(fault_return, 1) == 0) result = copy();
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  return result;
}

std::vector<kvcopy::PlaneCopy> plane_copies(const int64_t* src_table, const int64_t* dst_table, int64_t num_planes) {
  std::vector<kvcopy::PlaneCopy> planes(static_cast<size_t>(num_planes));
  for (int64_t p = 0; p < num_planes; ++p) {
    const int64_t* src = src_table + p * kvcopy::kPlaneTableColumns;
    const int64_t* dst = dst_table + p * kvcopy::kPlaneTableColumns;
    planes[p] = {reinterpret_cast<const uint8_t*>(src[kvcopy::kPlaneAddress]),
                 reinterpret_cast<uint8_t*>(dst[kvcopy::kPlaneAddress]), src[kvcopy::kPlaneBlockStride],
                 dst[kvcopy::kPlaneBlockStride], src[kvcopy::kPlaneBlockBytes]};
  }
  return planes;
}

}  // namespace

extern "C" {

// kvcopy::copy_blocks_sm over two plane tables in kvcopy's format (int64 [num_planes, kPlaneTableColumns],
// as PagedKV.plane_table): the CTA budget `num_ctas` as the launcher takes it, and `forced_grid` > 0 to run
// every launch with that many CTAs whatever the launcher computed. Returns the cudaError_t
// (cudaErrorIllegalAddress when the kernel faulted).
int kvcopy_host_copy_blocks_sm(const int64_t* src_table, const int64_t* dst_table, int64_t num_planes,
                               const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids, int64_t src_num_blocks,
                               int64_t dst_num_blocks, int num_ctas, int forced_grid) {
  const std::vector<kvcopy::PlaneCopy> planes = plane_copies(src_table, dst_table, num_planes);
  kvcopy_host_shim::launched_grids().clear();
  kvcopy_host_shim::forced_grid() = forced_grid;
  return catching_faults([&] {
    return kvcopy::copy_blocks_sm(planes.data(), num_planes, src_ids, dst_ids, num_ids, src_num_blocks, dst_num_blocks,
                                  num_ctas, nullptr);
  });
}

// The grids the launcher computed for the launches of the last call, up to `capacity` of them; returns how
// many launches there were.
int64_t kvcopy_host_launched_grids(int* grids, int64_t capacity) {
  const std::vector<int>& launched = kvcopy_host_shim::launched_grids();
  for (int64_t k = 0; k < capacity && k < static_cast<int64_t>(launched.size()); ++k) grids[k] = launched[k];
  return static_cast<int64_t>(launched.size());
}

// The table capacity (8, 64, 256) a launch of `num_planes` planes passes.
int64_t kvcopy_host_plane_table_capacity(int64_t num_planes) { return kvcopy::plane_table_capacity(num_planes); }

}  // extern "C"
