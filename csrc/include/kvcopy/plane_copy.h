// The block-copy descriptor shared by every kvcopy kernel. Torch-free.
//
// A paged KV cache is a list of planes; block b of a plane starts at
// `base + b * stride` and is `nbytes` contiguous bytes. Copying block ids
// src_ids[i] -> dst_ids[i] of every plane needs, per plane, exactly the fields
// below (source and destination share `nbytes`: validated in Python).
#pragma once

#include <cstdint>

namespace kvcopy {

struct PlaneCopy {
  const uint8_t* src;  // address of block 0 of the source plane
  uint8_t* dst;        // address of block 0 of the destination plane
  int64_t src_stride;  // bytes from one source block to the next
  int64_t dst_stride;  // bytes from one destination block to the next
  int64_t nbytes;      // bytes of one block of this plane
};

// True when consecutive blocks of the plane are adjacent on both sides, so a
// run of adjacent ids is one contiguous range of bytes.
inline bool plane_is_dense(const PlaneCopy& p) { return p.src_stride == p.nbytes && p.dst_stride == p.nbytes; }

}  // namespace kvcopy
