// The plane table: how the Python layer describes a PagedKV to the compiled
// code without the dispatcher unboxing a tensor list. One int64 row per plane,
// columns below; kvcopy/layout.py builds it (PLANE_TABLE_COLUMNS there names
// the same columns, and tests/core/test_host_fast_path.py checks the two agree). Torch-free.
#pragma once

#include <cstdint>

namespace kvcopy {

enum PlaneTableColumn : int64_t {
  kPlaneAddress = 0,      // address of block 0 of the plane
  kPlaneBlockStride = 1,  // bytes from one block to the next
  kPlaneBlockBytes = 2,   // bytes of one block of the plane
  kPlaneTableColumns = 3,
};

}  // namespace kvcopy
