// The one place kvcopy registers its ops: schemas, then CPU and CUDA kernels.
// Fake (meta) implementations for torch.compile live in kvcopy/_ext.py. The
// registrations run when the library loads (importing kvcopy._C, whose Python
// module is csrc/python/module.cpp).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(kvcopy, m) {
  // For every i and plane p: dst[p][dst_ids[i]] = src[p][src_ids[i]], bytewise.
  // num_ctas bounds the SM kernel's grid (<= 0: sized to the work).
  m.def(
      "copy_blocks(Tensor[] src, Tensor src_ids, Tensor(a!)[] dst, Tensor dst_ids, "
      "int num_ctas) -> ()");
  // The same copy on the DMA copy engines; ids live on the host.
  m.def("copy_blocks_dma(Tensor[] src, Tensor src_ids, Tensor(a!)[] dst, Tensor dst_ids) -> ()");
  // Raises IndexError / ValueError for host ids out of range, repeated
  // destinations or (same_cache) a block both read and written. Used where
  // the Python checks cannot run (torch.compile); registered as
  // side-effectful in kvcopy/_ext.py so graphs keep it.
  m.def(
      "check_block_ids(Tensor src_ids, Tensor dst_ids, int src_num_blocks, int dst_num_blocks, "
      "bool same_cache=False) -> ()");
}

TORCH_LIBRARY_IMPL(kvcopy, CPU, m) {
  m.impl("copy_blocks", &kvcopy::copy_blocks_cpu_op);
  m.impl("copy_blocks_dma", &kvcopy::copy_blocks_dma_cpu_op);
  m.impl("check_block_ids", &kvcopy::check_block_ids_op);
}

#ifdef KVCOPY_WITH_CUDA
TORCH_LIBRARY_IMPL(kvcopy, CUDA, m) {
  m.impl("copy_blocks", &kvcopy::copy_blocks_cuda_op);
  m.impl("copy_blocks_dma", &kvcopy::copy_blocks_dma_cuda_op);
}
#endif
