// ATen entry points of the host id checks (kvcopy/block_ids.h): the op that
// torch.compile graphs keep, and the check every op reading host ids runs.
#include <c10/util/Exception.h>

#include "aten_planes.h"
#include "kvcopy/block_ids.h"
#include "ops.h"

namespace kvcopy {

void check_block_ids_op(const at::Tensor& src_ids, const at::Tensor& dst_ids, int64_t src_blocks, int64_t dst_blocks,
                        bool same_cache) {
  check_id_tensor(src_ids, "src_ids", src_ids.numel());
  check_id_tensor(dst_ids, "dst_ids", dst_ids.numel());
  TORCH_CHECK_VALUE(src_ids.is_cpu() && dst_ids.is_cpu(), "kvcopy: ids are checked on the host, got ", src_ids.device(),
                    " and ", dst_ids.device());
  const IdProblem problem =
      check_ids(src_ids.const_data_ptr<int64_t>(), src_ids.numel(), dst_ids.const_data_ptr<int64_t>(), dst_ids.numel(),
                src_blocks, dst_blocks, same_cache);
  if (problem.kind == IdProblem::kNone) return;
  const std::string message = describe(problem, IdNames{}, src_ids.numel(), src_blocks, dst_blocks);
  TORCH_CHECK_INDEX(!is_index_problem(problem), message);
  TORCH_CHECK_VALUE(false, message);
}

void check_host_ids(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst, const at::Tensor& dst_ids) {
  // Planes at the same address: the same cache on both sides.
  const bool same_cache = !src.empty() && !dst.empty() && src[0].data_ptr() == dst[0].data_ptr();
  check_block_ids_op(src_ids, dst_ids, src.empty() ? 0 : src[0].size(0), dst.empty() ? 0 : dst[0].size(0), same_cache);
}

}  // namespace kvcopy
