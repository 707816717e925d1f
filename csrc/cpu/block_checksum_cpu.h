// CPU block checksums: the XXH3-64 of each block of a host buffer, split
// across threads. Torch-free: raw pointers and int64 sizes; ids are validated
// by the caller.
#pragma once

#include <cstdint>

namespace kvcopy {

// out[i] = XXH3-64 (seed 0) of the `block_bytes` bytes at base + ids[i] * block_bytes, for every
// i < num_ids, on the calling thread and up to `num_threads - 1` helpers (one block is never split: XXH3
// is sequential); it returns once every block is hashed, whether or not every helper has started.
void block_checksums_cpu(const uint8_t* base, int64_t block_bytes, const int64_t* ids, int64_t num_ids,
                         uint64_t* out, int num_threads);

}  // namespace kvcopy
