// Turns the plane tensors of an op call into torch-free PlaneCopy descriptors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

#include "kvcopy/plane_copy.h"

namespace kvcopy {

// Checks what the kernels rely on (the Python layer has already given the
// user a friendlier error for each of these) and builds one descriptor per plane.
inline std::vector<PlaneCopy> make_plane_table(at::TensorList src, at::TensorList dst) {
  TORCH_CHECK(src.size() == dst.size(), "kvcopy: src has ", src.size(), " planes, dst has ", dst.size());
  std::vector<PlaneCopy> planes;
  planes.reserve(src.size());
  for (size_t p = 0; p < src.size(); ++p) {
    const at::Tensor& s = src[p];
    const at::Tensor& d = dst[p];
    TORCH_CHECK(s.dim() >= 1 && d.dim() >= 1, "kvcopy: plane ", p, " has no block dimension");
    const int64_t nbytes = s.numel() / std::max<int64_t>(s.size(0), 1) * s.element_size();
    const int64_t dst_nbytes = d.numel() / std::max<int64_t>(d.size(0), 1) * d.element_size();
    TORCH_CHECK(nbytes == dst_nbytes, "kvcopy: plane ", p, " block is ", nbytes, " bytes in src and ", dst_nbytes,
                " in dst");
    planes.push_back({static_cast<const uint8_t*>(s.const_data_ptr()), static_cast<uint8_t*>(d.mutable_data_ptr()),
                      s.stride(0) * s.element_size(), d.stride(0) * d.element_size(), nbytes});
  }
  return planes;
}

inline void check_id_tensor(const at::Tensor& ids, const char* name, int64_t expected_len) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "kvcopy: ", name,
              " must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(ids.numel() == expected_len, "kvcopy: ", name, " has ", ids.numel(), " ids, expected ", expected_len);
}

}  // namespace kvcopy
