// The SM block-copy kernel. Torch-free: compiles in about a second per arch.
#include <algorithm>
#include <cstdint>

#include "block_copy_cuda.h"

namespace kvcopy {
namespace {

// 32 warps per CTA, each with kUnroll 16-byte loads in flight: with the
// 4-CTA host budget that is 256 KiB outstanding, above PCIe Gen5's
// bandwidth-delay product (~57 GB/s x ~2 us).
constexpr int kThreadsPerCta = 1024;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerCta = kThreadsPerCta / kWarpSize;
constexpr int kUnroll = 4;

struct BlockCopyArgs {
  const int64_t* src_ids;  // [num_ids]
  const int64_t* dst_ids;  // [num_ids]
  int64_t num_ids;
  int64_t src_num_blocks;
  int64_t dst_num_blocks;
  int64_t num_planes;  // <= kMaxPlanesPerLaunch
  PlaneCopy planes[kMaxPlanesPerLaunch];
};

// Grid: (num_ctas), block: (kThreadsPerCta). Work item w = i * num_planes + p
// copies block src_ids[i] -> dst_ids[i] of plane p; warps stride over items.
// Vec is the widest type dividing every address, stride and size (<= 16 B).
template <typename Vec>
__global__ void __launch_bounds__(kThreadsPerCta)
    block_copy_kernel(const __grid_constant__ BlockCopyArgs args) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  const int64_t num_items = args.num_ids * args.num_planes;
  for (int64_t item = first_warp; item < num_items; item += num_warps) {
    const int64_t i = item / args.num_planes;
    const PlaneCopy& plane = args.planes[item % args.num_planes];
    const int64_t src_id = args.src_ids[i];
    const int64_t dst_id = args.dst_ids[i];
    if (src_id < 0 || src_id >= args.src_num_blocks || dst_id < 0 || dst_id >= args.dst_num_blocks) {
      continue;
    }
    const Vec* src = reinterpret_cast<const Vec*>(plane.src + src_id * plane.src_stride);
    Vec* dst = reinterpret_cast<Vec*>(plane.dst + dst_id * plane.dst_stride);
    const int64_t num_vecs = plane.nbytes / static_cast<int64_t>(sizeof(Vec));
    for (int64_t base = lane; base < num_vecs; base += kWarpSize * kUnroll) {
      Vec staged[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = base + u * kWarpSize;
        if (k < num_vecs) staged[u] = src[k];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = base + u * kWarpSize;
        if (k < num_vecs) dst[k] = staged[u];
      }
    }
  }
}

// Largest power of two <= 16 dividing every address, stride and block size.
int common_alignment(const PlaneCopy* planes, int64_t num_planes) {
  uint64_t bits = 16;
  for (int64_t p = 0; p < num_planes; ++p) {
    bits |= reinterpret_cast<uintptr_t>(planes[p].src) | reinterpret_cast<uintptr_t>(planes[p].dst) |
            static_cast<uint64_t>(planes[p].src_stride) | static_cast<uint64_t>(planes[p].dst_stride) |
            static_cast<uint64_t>(planes[p].nbytes);
  }
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

template <typename Vec>
cudaError_t launch_with(const BlockCopyArgs& args, int num_ctas, cudaStream_t stream) {
  block_copy_kernel<Vec><<<num_ctas, kThreadsPerCta, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_aligned(const BlockCopyArgs& args, int alignment, int num_ctas,
                           cudaStream_t stream) {
  switch (alignment) {
    case 16: return launch_with<uint4>(args, num_ctas, stream);
    case 8: return launch_with<uint2>(args, num_ctas, stream);
    case 4: return launch_with<uint32_t>(args, num_ctas, stream);
    case 2: return launch_with<uint16_t>(args, num_ctas, stream);
    default: return launch_with<uint8_t>(args, num_ctas, stream);
  }
}

// The launchers make the stream's device current before calling in.
cudaError_t grid_for_work(int64_t num_items, int requested, int* num_ctas) {
  const int64_t needed = (num_items + kWarpsPerCta - 1) / kWarpsPerCta;
  if (requested > 0) {
    *num_ctas = static_cast<int>(std::min<int64_t>(requested, needed));
    return cudaSuccess;
  }
  int device = 0;
  int num_sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  *num_ctas = static_cast<int>(std::min<int64_t>(2 * static_cast<int64_t>(num_sms), needed));
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_block_copy_kernel(const PlaneCopy* planes, int64_t num_planes,
                                     const int64_t* src_ids, const int64_t* dst_ids,
                                     int64_t num_ids, int64_t src_num_blocks,
                                     int64_t dst_num_blocks, int num_ctas, cudaStream_t stream) {
  if (num_ids <= 0 || num_planes <= 0) return cudaSuccess;
  for (int64_t first = 0; first < num_planes; first += kMaxPlanesPerLaunch) {
    BlockCopyArgs args{};
    args.src_ids = src_ids;
    args.dst_ids = dst_ids;
    args.num_ids = num_ids;
    args.src_num_blocks = src_num_blocks;
    args.dst_num_blocks = dst_num_blocks;
    args.num_planes = std::min(kMaxPlanesPerLaunch, num_planes - first);
    std::copy(planes + first, planes + first + args.num_planes, args.planes);
    int grid = 0;
    cudaError_t err = grid_for_work(num_ids * args.num_planes, num_ctas, &grid);
    if (err != cudaSuccess) return err;
    err = launch_aligned(args, common_alignment(args.planes, args.num_planes), grid, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace kvcopy
