// CPU block copy: coalesced runs of adjacent ids, memcpy, split across threads.
// Torch-free: raw pointers and int64 sizes; ids are validated by the caller
// (kvcopy/block_ids.h).
#pragma once

#include <cstdint>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

// For every plane p and every i < num_ids copies block src_ids[i] of plane p
// to block dst_ids[i], using at most `num_threads` OpenMP threads. Ids must
// have passed check_ids (kvcopy/block_ids.h); no block may be both a source and a destination.
void copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                     int64_t num_ids, int num_threads);

}  // namespace kvcopy
