// The SM block-copy kernel. Torch-free: compiles in about a second per arch.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "copy_blocks_sm.h"

namespace kvcopy {
namespace {

// 32 warps per CTA, each with kUnroll 16-byte loads in flight: with the
// 4-CTA host budget that is 256 KiB outstanding, above PCIe Gen5's
// bandwidth-delay product (~57 GB/s x ~2 us).
constexpr int kThreadsPerCta = 1024;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerCta = kThreadsPerCta / kWarpSize;
constexpr int kUnroll = 4;

// A block larger than this is split into several work items, so that a few
// large blocks still spread over many warps (32 KiB = 64 16-byte vectors a lane).
constexpr int64_t kMaxItemBytes = 32 * 1024;

// Plane-table capacities a launch can take, smallest first: the table travels in
// the kernel's parameters (40 B a plane), so a launch of a few planes (one layer
// of a layer-wise reload) passes 320 B instead of 10 KiB.
constexpr int64_t kSmallTable = 8;
constexpr int64_t kMediumTable = 64;
static_assert(kMaxPlanesPerLaunch == 256, "the largest table capacity is kMaxPlanesPerLaunch");

// The launch, spelled through a macro so that csrc/kernels/host_shim/ can run this same source on the CPU
// (every CTA and thread in turn); under nvcc it is the plain triple-chevron launch.
#ifndef KVCOPY_LAUNCH
#define KVCOPY_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#endif

template <int64_t kCapacity>
struct CopyBlocksSmArgs {
  const int64_t* src_ids;  // [num_ids]
  const int64_t* dst_ids;  // [num_ids]
  int64_t num_ids;
  int64_t src_num_blocks;
  int64_t dst_num_blocks;
  int64_t num_planes;        // <= kCapacity
  int64_t chunks_per_block;  // ceil(largest block / kMaxItemBytes)
  PlaneCopy planes[kCapacity];
};

// One warp copies `nbytes` from src to dst in Vec-sized words, kUnroll loads
// in flight per lane. Both pointers and nbytes are multiples of sizeof(Vec).
template <typename Vec>
__device__ __forceinline__ void warp_copy(const uint8_t* src_bytes, uint8_t* dst_bytes, int64_t nbytes, int lane) {
  const Vec* src = reinterpret_cast<const Vec*>(src_bytes);
  Vec* dst = reinterpret_cast<Vec*>(dst_bytes);
  const int64_t num_vecs = nbytes / static_cast<int64_t>(sizeof(Vec));
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

// Grid: (num_ctas), block: (kThreadsPerCta). Work item
// w = (i * num_planes + p) * chunks_per_block + c copies chunk c (kMaxItemBytes)
// of block src_ids[i] -> dst_ids[i] of plane p; warps stride over items. Each
// item uses the widest word (<= 16 B) its addresses and size allow: the choice
// is uniform across the warp, so mixed plane alignments cost no divergence.
template <int64_t kCapacity>
__global__ void __launch_bounds__(kThreadsPerCta)
    copy_blocks_sm_kernel(const __grid_constant__ CopyBlocksSmArgs<kCapacity> args) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  const int64_t num_items = args.num_ids * args.num_planes * args.chunks_per_block;
  for (int64_t item = first_warp; item < num_items; item += num_warps) {
    const int64_t chunk = item % args.chunks_per_block;
    const int64_t pair = item / args.chunks_per_block;
    const int64_t i = pair / args.num_planes;
    const PlaneCopy& plane = args.planes[pair % args.num_planes];
    const int64_t offset = chunk * kMaxItemBytes;
    if (offset >= plane.nbytes) continue;
    const int64_t src_id = args.src_ids[i];
    const int64_t dst_id = args.dst_ids[i];
    if (src_id < 0 || src_id >= args.src_num_blocks || dst_id < 0 || dst_id >= args.dst_num_blocks) continue;
    const uint8_t* src = plane.src + src_id * plane.src_stride + offset;
    uint8_t* dst = plane.dst + dst_id * plane.dst_stride + offset;
    const int64_t nbytes = min(kMaxItemBytes, plane.nbytes - offset);
    const uint64_t bits =
        reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | static_cast<uint64_t>(nbytes);
    if (bits % 16 == 0) {
      warp_copy<uint4>(src, dst, nbytes, lane);
    } else if (bits % 8 == 0) {
      warp_copy<uint2>(src, dst, nbytes, lane);
    } else if (bits % 4 == 0) {
      warp_copy<uint32_t>(src, dst, nbytes, lane);
    } else if (bits % 2 == 0) {
      warp_copy<uint16_t>(src, dst, nbytes, lane);
    } else {
      warp_copy<uint8_t>(src, dst, nbytes, lane);
    }
  }
}

// CTAs of the kernel with capacity kCapacity that fit on one SM at once (its
// registers decide: about 62 a thread, so one 1024-thread CTA on current GPUs),
// per device, asked once.
template <int64_t kCapacity>
cudaError_t resident_ctas(int device, int* per_sm, int* num_sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached_per_sm[kMaxDevices];
  static std::atomic<int> cached_sms[kMaxDevices];
  if (device >= 0 && device < kMaxDevices && cached_per_sm[device].load() > 0) {
    *per_sm = cached_per_sm[device].load();
    *num_sms = cached_sms[device].load();
    return cudaSuccess;
  }
  cudaError_t err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, copy_blocks_sm_kernel<kCapacity>, kThreadsPerCta, 0);
  if (err != cudaSuccess) return err;
  *per_sm = std::max(*per_sm, 1);
  if (device >= 0 && device < kMaxDevices) {
    cached_sms[device].store(*num_sms);
    cached_per_sm[device].store(*per_sm);
  }
  return cudaSuccess;
}

// The grid: `requested` CTAs (a budget), or as many as are resident on the whole
// GPU at once (one wave), never more than there are warps' worth of items.
template <int64_t kCapacity>
cudaError_t grid_for_work(int64_t num_items, int requested, int* num_ctas) {
  const int64_t needed = (num_items + kWarpsPerCta - 1) / kWarpsPerCta;
  if (requested > 0) {
    *num_ctas = static_cast<int>(std::min<int64_t>(requested, needed));
    return cudaSuccess;
  }
  int device = 0, per_sm = 1, num_sms = 1;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if ((err = resident_ctas<kCapacity>(device, &per_sm, &num_sms)) != cudaSuccess) return err;
  *num_ctas = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(per_sm) * num_sms, needed));
  return cudaSuccess;
}

template <int64_t kCapacity>
cudaError_t launch_planes(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                          int64_t num_ids, int64_t src_num_blocks, int64_t dst_num_blocks, int num_ctas,
                          cudaStream_t stream) {
  CopyBlocksSmArgs<kCapacity> args{};
  args.src_ids = src_ids;
  args.dst_ids = dst_ids;
  args.num_ids = num_ids;
  args.src_num_blocks = src_num_blocks;
  args.dst_num_blocks = dst_num_blocks;
  args.num_planes = num_planes;
  std::copy(planes, planes + num_planes, args.planes);
  int64_t largest = 1;
  for (int64_t p = 0; p < num_planes; ++p) largest = std::max(largest, args.planes[p].nbytes);
  args.chunks_per_block = (largest + kMaxItemBytes - 1) / kMaxItemBytes;
  int grid = 0;
  cudaError_t err = grid_for_work<kCapacity>(num_ids * num_planes * args.chunks_per_block, num_ctas, &grid);
  if (err != cudaSuccess) return err;
  KVCOPY_LAUNCH(copy_blocks_sm_kernel<kCapacity>, grid, kThreadsPerCta, stream)(args);
  return cudaGetLastError();
}

}  // namespace

int64_t plane_table_capacity(int64_t num_planes) {
  if (num_planes <= kSmallTable) return kSmallTable;
  if (num_planes <= kMediumTable) return kMediumTable;
  return kMaxPlanesPerLaunch;
}

cudaError_t copy_blocks_sm_grid(int64_t num_items, int64_t num_planes, int requested, int* num_ctas) {
  switch (plane_table_capacity(num_planes)) {
    case kSmallTable:
      return grid_for_work<kSmallTable>(num_items, requested, num_ctas);
    case kMediumTable:
      return grid_for_work<kMediumTable>(num_items, requested, num_ctas);
    default:
      return grid_for_work<kMaxPlanesPerLaunch>(num_items, requested, num_ctas);
  }
}

// The launchers make the stream's device current before calling in.
cudaError_t copy_blocks_sm(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                           int64_t num_ids, int64_t src_num_blocks, int64_t dst_num_blocks, int num_ctas,
                           cudaStream_t stream) {
  if (num_ids <= 0 || num_planes <= 0) return cudaSuccess;
  for (int64_t first = 0; first < num_planes; first += kMaxPlanesPerLaunch) {
    const int64_t count = std::min(kMaxPlanesPerLaunch, num_planes - first);
    cudaError_t err = cudaSuccess;
    switch (plane_table_capacity(count)) {
      case kSmallTable:
        err = launch_planes<kSmallTable>(planes + first, count, src_ids, dst_ids, num_ids, src_num_blocks,
                                         dst_num_blocks, num_ctas, stream);
        break;
      case kMediumTable:
        err = launch_planes<kMediumTable>(planes + first, count, src_ids, dst_ids, num_ids, src_num_blocks,
                                          dst_num_blocks, num_ctas, stream);
        break;
      default:
        err = launch_planes<kMaxPlanesPerLaunch>(planes + first, count, src_ids, dst_ids, num_ids, src_num_blocks,
                                                 dst_num_blocks, num_ctas, stream);
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace kvcopy
