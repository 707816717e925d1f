#include "kvcopy/block_ids.h"

#include <algorithm>
#include <vector>

namespace kvcopy {
namespace {

// Up to this many ids, repeats are found by comparing every pair: no
// allocation, and faster than a bitmap over the cache's blocks.
constexpr int64_t kPairwiseMaxIds = 16;

bool has_pairwise_repeat(const int64_t* ids, int64_t n, int64_t* repeated) {
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) {
      if (ids[i] == ids[j]) {
        *repeated = ids[i];
        return true;
      }
    }
  }
  return false;
}

// The id reported for ids out of [0, num_blocks): the smallest when one is negative, else the largest.
bool out_of_range(const int64_t* ids, int64_t n, int64_t num_blocks, int64_t* reported) {
  if (n == 0) return false;
  const auto [low, high] = std::minmax_element(ids, ids + n);
  if (*low < 0) {
    *reported = *low;
    return true;
  }
  if (*high >= num_blocks) {
    *reported = *high;
    return true;
  }
  return false;
}

}  // namespace

IdProblem check_id_side(const int64_t* ids, int64_t n, int64_t num_blocks, bool destination) {
  int64_t id = 0;
  if (out_of_range(ids, n, num_blocks, &id)) {
    return {destination ? IdProblem::kDstOutOfRange : IdProblem::kSrcOutOfRange, id};
  }
  if (!destination) return {};
  if (n <= kPairwiseMaxIds) {
    if (has_pairwise_repeat(ids, n, &id)) return {IdProblem::kDstRepeated, id};
    return {};
  }
  std::vector<bool> seen(static_cast<size_t>(num_blocks));
  for (int64_t i = 0; i < n; ++i) {
    if (seen[ids[i]]) return {IdProblem::kDstRepeated, ids[i]};
    seen[ids[i]] = true;
  }
  return {};
}

IdProblem check_ids(const int64_t* src_ids, int64_t src_len, const int64_t* dst_ids, int64_t dst_len,
                    int64_t src_num_blocks, int64_t dst_num_blocks, bool same_cache) {
  // Each side, then the pair: the order the Python fallback (kvcopy/ids.py) follows too.
  IdProblem problem = check_id_side(src_ids, src_len, src_num_blocks, /*destination=*/false);
  if (problem.kind != IdProblem::kNone) return problem;
  problem = check_id_side(dst_ids, dst_len, dst_num_blocks, /*destination=*/true);
  if (problem.kind != IdProblem::kNone) return problem;
  const int64_t n = dst_len;
  if (src_len != dst_len) return {IdProblem::kLengthMismatch, dst_len};
  if (!same_cache || n == 0) return {};
  // The first source id (in order) that is also written.
  if (n <= kPairwiseMaxIds) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        if (src_ids[i] == dst_ids[j]) return {IdProblem::kReadAndWritten, src_ids[i]};
      }
    }
    return {};
  }
  std::vector<bool> written(static_cast<size_t>(dst_num_blocks));
  for (int64_t i = 0; i < n; ++i) written[dst_ids[i]] = true;
  for (int64_t i = 0; i < n; ++i) {
    if (written[src_ids[i]]) return {IdProblem::kReadAndWritten, src_ids[i]};
  }
  return {};
}

std::string describe(const IdProblem& problem, const IdNames& names, int64_t src_len, int64_t src_num_blocks,
                     int64_t dst_num_blocks) {
  const std::string id = std::to_string(problem.id);
  switch (problem.kind) {
    case IdProblem::kLengthMismatch:
      return std::string(names.dst) + ": expected as many ids as " + names.src + " (" + std::to_string(src_len) +
             "), got " + id;
    case IdProblem::kSrcOutOfRange:
      return std::string(names.src) + ": expected ids in [0, " + std::to_string(src_num_blocks) + "), got " + id;
    case IdProblem::kDstOutOfRange:
      return std::string(names.dst) + ": expected ids in [0, " + std::to_string(dst_num_blocks) + "), got " + id;
    case IdProblem::kDstRepeated:
      return std::string(names.dst) + ": expected distinct destination ids (repeats would race), got " + id +
             " more than once";
    case IdProblem::kReadAndWritten:
      return std::string(names.dst) + ": block " + id +
             " is both a source and a destination within one cache; copy in two calls or through a spare block";
    case IdProblem::kNone:
      break;
  }
  return "";
}

}  // namespace kvcopy
