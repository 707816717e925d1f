// Thin ATen launcher for the CPU block copy.
#include <ATen/Parallel.h>

#include "../cpu/block_copy_cpu.h"
#include "ops.h"
#include "plane_table.h"

namespace kvcopy {

void check_block_ids_op(const at::Tensor& src_ids, const at::Tensor& dst_ids, int64_t src_blocks,
                        int64_t dst_blocks, bool same_cache) {
  check_id_tensor(src_ids, "src_ids", src_ids.numel());
  check_id_tensor(dst_ids, "dst_ids", src_ids.numel());
  TORCH_CHECK_VALUE(src_ids.is_cpu() && dst_ids.is_cpu(), "kvcopy: ids are checked on the host, got ",
                    src_ids.device(), " and ", dst_ids.device());
  const IdProblem problem = check_ids(src_ids.const_data_ptr<int64_t>(), dst_ids.const_data_ptr<int64_t>(),
                                      src_ids.numel(), src_blocks, dst_blocks, same_cache);
  TORCH_CHECK_INDEX(problem.kind != IdProblem::kSrcOutOfRange, "src_ids: expected ids in [0, ", src_blocks,
                    "), got ", problem.id);
  TORCH_CHECK_INDEX(problem.kind != IdProblem::kDstOutOfRange, "dst_ids: expected ids in [0, ", dst_blocks,
                    "), got ", problem.id);
  TORCH_CHECK_VALUE(problem.kind != IdProblem::kDstRepeated,
                    "dst_ids: expected distinct destination ids (repeats would race), got ", problem.id,
                    " more than once");
  TORCH_CHECK_VALUE(problem.kind != IdProblem::kReadAndWritten, "dst_ids: block ", problem.id,
                    " is both a source and a destination within one cache; copy in two calls or through a "
                    "spare block");
}

void check_host_ids(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                    const at::Tensor& dst_ids) {
  // Planes at the same address: the same cache on both sides.
  const bool same_cache = !src.empty() && !dst.empty() && src[0].data_ptr() == dst[0].data_ptr();
  check_block_ids_op(src_ids, dst_ids, src.empty() ? 0 : src[0].size(0), dst.empty() ? 0 : dst[0].size(0),
                     same_cache);
}

void copy_blocks_cpu_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                        const at::Tensor& dst_ids, int64_t /*num_ctas: unused on CPU*/) {
  const std::vector<PlaneCopy> planes = make_plane_table(src, dst);
  check_host_ids(src, src_ids, dst, dst_ids);
  copy_blocks_cpu(planes.data(), static_cast<int64_t>(planes.size()),
                  src_ids.const_data_ptr<int64_t>(), dst_ids.const_data_ptr<int64_t>(),
                  src_ids.numel(), at::get_num_threads());
}

void copy_blocks_dma_cpu_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                            const at::Tensor& dst_ids) {
  copy_blocks_cpu_op(src, src_ids, dst, dst_ids, 0);
}

}  // namespace kvcopy
