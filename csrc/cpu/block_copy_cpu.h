// CPU block copy: coalesced runs of adjacent ids, memcpy, split across threads.
// Torch-free: raw pointers and int64 sizes; ids are validated by the caller.
#pragma once

#include <cstdint>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

// What is wrong with a pair of host id arrays, if anything.
struct IdProblem {
  enum Kind { kNone, kSrcOutOfRange, kDstOutOfRange, kDstRepeated, kReadAndWritten } kind = kNone;
  int64_t id = 0;  // the offending id
};

// Checks src ids in [0, src_num_blocks), dst ids in [0, dst_num_blocks) and
// distinct, and with `same_cache` that no block is both read and written.
// O(num_ids + dst_num_blocks / 8) time and memory.
IdProblem check_ids(const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids,
                    int64_t src_num_blocks, int64_t dst_num_blocks, bool same_cache);

// For every plane p and every i < num_ids copies block src_ids[i] of plane p
// to block dst_ids[i], using at most `num_threads` OpenMP threads. Ids must
// have passed check_ids; no block may be both a source and a destination.
void copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                     const int64_t* dst_ids, int64_t num_ids, int num_threads);

}  // namespace kvcopy
