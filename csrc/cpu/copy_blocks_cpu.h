// CPU block copy: coalesced runs of adjacent ids, memcpy, split across threads.
// Torch-free: raw pointers and int64 sizes; ids are validated by the caller
// (kvcopy/block_ids.h).
#pragma once

#include <cstdint>
#include <vector>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

// One contiguous copy of the CPU path: a planned range (kvcopy/copy_ranges.h), or a cut of one.
struct CopyPiece {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
};

// How copy_blocks_cpu copies one call: what it plans before the first byte moves.
struct CpuCopyPlan {
  std::vector<CopyPiece> pieces;     // in copy order
  std::vector<int64_t> first_piece;  // thread t copies pieces [first_piece[t], first_piece[t + 1])
  int64_t total_bytes = 0;
  bool streaming = false;     // non-temporal stores, the source prefetched ahead along each thread's pieces
  bool source_order = false;  // the ids taken in ascending order of their source block
};

// The plan of copy_blocks_cpu for these arguments (tests read it through kvcopy._C).
CpuCopyPlan plan_copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                 const int64_t* dst_ids, int64_t num_ids, int num_threads);

// For every plane p and every i < num_ids copies block src_ids[i] of plane p
// to block dst_ids[i], using at most `num_threads` OpenMP threads. Ids must
// have passed check_ids (kvcopy/block_ids.h); no block may be both a source and a destination.
void copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                     int64_t num_ids, int num_threads);

}  // namespace kvcopy
