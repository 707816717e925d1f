// The byte ranges a block copy moves, planned once for the CPU and DMA paths.
// Torch-free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcopy/id_runs.h"
#include "kvcopy/plane_copy.h"

namespace kvcopy {

struct CopyRange {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
};

// A HostKVPool registers its memory with CUDA in chunks that end at multiples of
// this address (kvcopy/host/memory.py, MAX_REGISTER_BYTES: one registration of
// 512 GiB or more fails). One DMA copy must not span two registrations.
constexpr int64_t kRegistrationChunkBytes = int64_t{64} << 30;

// The ranges split wherever either side crosses a multiple of kRegistrationChunkBytes.
inline std::vector<CopyRange> split_at_registrations(const std::vector<CopyRange>& ranges) {
  std::vector<CopyRange> out;
  out.reserve(ranges.size());
  for (CopyRange range : ranges) {
    while (range.nbytes > 0) {
      const auto room = [](const void* p) {
        const auto address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
        return kRegistrationChunkBytes - address % kRegistrationChunkBytes;
      };
      const int64_t n = std::min({range.nbytes, room(range.src), room(range.dst)});
      out.push_back({range.src, range.dst, n});
      range.src += n;
      range.dst += n;
      range.nbytes -= n;
    }
  }
  return out;
}

// Appends a range, extending the previous one when both sides continue it.
inline void append_range(std::vector<CopyRange>& ranges, const uint8_t* src, uint8_t* dst, int64_t nbytes) {
  if (nbytes <= 0) return;
  if (!ranges.empty()) {
    CopyRange& last = ranges.back();
    if (last.src + last.nbytes == src && last.dst + last.nbytes == dst) {
      last.nbytes += nbytes;
      return;
    }
  }
  ranges.push_back({src, dst, nbytes});
}

// Every byte range of copying src_ids[i] -> dst_ids[i] in every plane, merged
// where both sides are adjacent:
// - a run of adjacent ids in a plane dense on both sides is one range;
// - other planes are emitted block by block, planes in order, so planes that
//   sit side by side in both layouts merge (FlashInfer's K and V of a layer
//   into a page-first host block: one range per layer instead of two).
inline std::vector<CopyRange> plan_copy_ranges(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                               const int64_t* dst_ids, int64_t num_ids) {
  std::vector<CopyRange> ranges;
  ranges.reserve(static_cast<size_t>(num_ids * num_planes));
  for (const IdRun& run : find_id_runs(src_ids, dst_ids, num_ids)) {
    for (int64_t p = 0; p < num_planes; ++p) {
      const PlaneCopy& plane = planes[p];
      if (plane_is_dense(plane)) {
        append_range(ranges, plane.src + run.src_id * plane.src_stride, plane.dst + run.dst_id * plane.dst_stride,
                     run.length * plane.nbytes);
      }
    }
    for (int64_t k = 0; k < run.length; ++k) {
      for (int64_t p = 0; p < num_planes; ++p) {
        const PlaneCopy& plane = planes[p];
        if (!plane_is_dense(plane)) {
          append_range(ranges, plane.src + (run.src_id + k) * plane.src_stride,
                       plane.dst + (run.dst_id + k) * plane.dst_stride, plane.nbytes);
        }
      }
    }
  }
  return ranges;
}

}  // namespace kvcopy
