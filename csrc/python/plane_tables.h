// Plane tables passed from Python by address, read into PlaneCopy records: how
// every pybind11 entry point that copies receives a PagedKV. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcopy/plane_copy.h"
#include "kvcopy/plane_table.h"

namespace kvcopy {

using Address = std::uintptr_t;  // a pointer passed from Python as an int

template <typename T>
T* as_ptr(Address address) {
  return reinterpret_cast<T*>(address);
}

// The planes of a copy from two plane tables (kvcopy/plane_table.h) of `num_planes` rows each.
inline std::vector<PlaneCopy> planes_from_tables(Address src_table, Address dst_table, int64_t num_planes) {
  const int64_t* src = as_ptr<const int64_t>(src_table);
  const int64_t* dst = as_ptr<const int64_t>(dst_table);
  std::vector<PlaneCopy> planes(static_cast<size_t>(num_planes));
  for (int64_t p = 0; p < num_planes; ++p) {
    const int64_t* s = src + p * kPlaneTableColumns;
    const int64_t* d = dst + p * kPlaneTableColumns;
    planes[p] = {as_ptr<const uint8_t>(static_cast<Address>(s[kPlaneAddress])),
                 as_ptr<uint8_t>(static_cast<Address>(d[kPlaneAddress])), s[kPlaneBlockStride], d[kPlaneBlockStride],
                 s[kPlaneBlockBytes]};
  }
  return planes;
}

}  // namespace kvcopy
