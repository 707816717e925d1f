// Validation of host-resident block ids: the one implementation, and the one
// wording of its errors, shared by the registered ops (torch.compile) and the
// eager fast path. Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace kvcopy {

// What is wrong with a pair of host id arrays, if anything.
struct IdProblem {
  enum Kind { kNone, kLengthMismatch, kSrcOutOfRange, kDstOutOfRange, kDstRepeated, kReadAndWritten };
  Kind kind = kNone;
  int64_t id = 0;  // the offending id (kLengthMismatch: the destination's length)
};

// Checks one side of a copy: ids in [0, num_blocks) and, for the destination, distinct (kSrcOutOfRange
// or kDstOutOfRange / kDstRepeated by `destination`). For ids whose other side is not on the host.
IdProblem check_id_side(const int64_t* ids, int64_t n, int64_t num_blocks, bool destination);

// Checks that both arrays have one length, src ids lie in [0, src_num_blocks),
// dst ids in [0, dst_num_blocks) and are distinct, and with `same_cache` that
// no block is both read and written. O(num_ids + dst_num_blocks / 8) time and
// memory (O(num_ids^2) for a handful of ids, with no allocation).
IdProblem check_ids(const int64_t* src_ids, int64_t src_len, const int64_t* dst_ids, int64_t dst_len,
                    int64_t src_num_blocks, int64_t dst_num_blocks, bool same_cache);

// The names the caller gave its id arguments, for messages.
struct IdNames {
  const char* src = "src_ids";
  const char* dst = "dst_ids";
};

// True for problems reported as IndexError (an id out of range); the others are ValueError.
inline bool is_index_problem(const IdProblem& problem) {
  return problem.kind == IdProblem::kSrcOutOfRange || problem.kind == IdProblem::kDstOutOfRange;
}

// The message for `problem` (kind != kNone), naming the argument, what was expected and what was given.
std::string describe(const IdProblem& problem, const IdNames& names, int64_t src_len, int64_t src_num_blocks,
                     int64_t dst_num_blocks);

}  // namespace kvcopy
