// A host stand-in for <cuda_runtime_api.h>, so that csrc/kernels/copy_blocks_sm.cu compiles as plain C++
// and its kernel runs on the CPU (tests/core/test_sm_kernel_on_host.py). Never part of the extension: only
// the test's g++ command puts this folder on the include path. It holds what the kernel source uses and no
// more: the CUDA keywords, the built-in index variables, the vector types, min(), the runtime calls, and a
// launch (KVCOPY_LAUNCH) that runs every thread of every CTA in turn. The kernel has no shared memory and no
// barrier, so that order is one of the executions a GPU may choose.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

// ---------------------------------------------------------------------------- keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __launch_bounds__(...)

// ---------------------------------------------------------------------------- built-in variables
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
// One CPU thread runs one simulated GPU thread at a time; these say which.
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{};
inline thread_local dim3 gridDim{};

// ---------------------------------------------------------------------------- vector types
// The sizes and alignments CUDA gives them: an access through a misaligned pointer is what faults on a GPU,
// and the test's -fsanitize=alignment reports it here.
struct alignas(8) int2 {
  int x, y;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) longlong2 {
  long long x, y;
};
static_assert(sizeof(uint2) == 8 && alignof(uint2) == 8, "CUDA's uint2");
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "CUDA's uint4");

// ---------------------------------------------------------------------------- device functions
template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// ---------------------------------------------------------------------------- runtime
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorIllegalAddress = 700 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace kvcopy_host_shim {

// The simulated GPU: a few SMs, one resident 1024-thread CTA each (the kernel's occupancy on real GPUs),
// so a launch sized by the runtime ("one wave") has a grid smaller than most tests' work.
constexpr int kSmCount = 3;
constexpr int kCtasPerSm = 1;

// The grid of each launch since the last clear(), as the launcher computed it.
inline std::vector<int>& launched_grids() {
  static std::vector<int> grids;
  return grids;
}
// When positive, every launch runs this many CTAs instead of the grid the launcher computed, so a test can
// run the kernel under grids larger and smaller than the work.
inline int& forced_grid() {
  static int grid = 0;
  return grid;
}

// Runs kernel(args...) for every (CTA, thread) of a 1-D grid, one after the other.
template <typename Kernel>
auto launch(Kernel kernel, int grid, int block) {
  return [=](const auto&... args) {
    launched_grids().push_back(grid);
    const int ctas = forced_grid() > 0 ? forced_grid() : grid;
    gridDim = dim3{static_cast<unsigned int>(ctas), 1, 1};
    blockDim = dim3{static_cast<unsigned int>(block), 1, 1};
    for (int cta = 0; cta < ctas; ++cta) {
      for (int thread = 0; thread < block; ++thread) {
        blockIdx = uint3{static_cast<unsigned int>(cta), 0, 0};
        threadIdx = uint3{static_cast<unsigned int>(thread), 0, 0};
        kernel(args...);
      }
    }
  };
}

}  // namespace kvcopy_host_shim

#define KVCOPY_LAUNCH(kernel, grid, block, stream) \
  (static_cast<void>(stream), ::kvcopy_host_shim::launch(kernel, (grid), (block)))

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = kvcopy_host_shim::kSmCount;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, Kernel /*kernel*/, int /*block_size*/,
                                                          size_t /*dynamic_smem*/) {
  *num_blocks = kvcopy_host_shim::kCtasPerSm;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
