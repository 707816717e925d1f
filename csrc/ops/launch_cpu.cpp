// The ops' CPU launchers: kvcopy::copy_blocks and kvcopy::copy_blocks_dma on CPU tensors, as thin
// ATen calls of the torch-free CPU copy.
#include <ATen/Parallel.h>

#include "../cpu/copy_blocks_cpu.h"
#include "aten_planes.h"
#include "ops.h"

namespace kvcopy {

void copy_blocks_cpu_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst, const at::Tensor& dst_ids,
                        int64_t /*num_ctas: unused on CPU*/) {
  const std::vector<PlaneCopy> planes = make_plane_table(src, dst);
  check_host_ids(src, src_ids, dst, dst_ids);
  copy_blocks_cpu(planes.data(), static_cast<int64_t>(planes.size()), src_ids.const_data_ptr<int64_t>(),
                  dst_ids.const_data_ptr<int64_t>(), src_ids.numel(), at::get_num_threads());
}

void copy_blocks_dma_cpu_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                            const at::Tensor& dst_ids) {
  copy_blocks_cpu_op(src, src_ids, dst, dst_ids, 0);
}

}  // namespace kvcopy
