// Runs of adjacent block ids: the unit both the CPU path and the DMA path
// coalesce into one copy. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcopy {

struct IdRun {
  int64_t src_id;  // first source block of the run
  int64_t dst_id;  // first destination block of the run
  int64_t length;  // number of blocks; src and dst both advance by one
};

// Splits (src_ids[i], dst_ids[i]) into maximal runs where both sides advance
// by exactly one block per step.
inline std::vector<IdRun> find_id_runs(const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids) {
  std::vector<IdRun> runs;
  for (int64_t i = 0; i < num_ids; ++i) {
    if (!runs.empty()) {
      IdRun& last = runs.back();
      if (src_ids[i] == last.src_id + last.length && dst_ids[i] == last.dst_id + last.length) {
        ++last.length;
        continue;
      }
    }
    runs.push_back({src_ids[i], dst_ids[i], 1});
  }
  return runs;
}

}  // namespace kvcopy
