// ATen entry points of the kvcopy ops; schemas live in csrc/ops/registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvcopy {

// kvcopy::check_block_ids: full checks of host ids (range, distinct
// destinations, and with same_cache no block both read and written):
// IndexError / ValueError in Python, nothing written.
void check_block_ids_op(const at::Tensor& src_ids, const at::Tensor& dst_ids, int64_t src_num_blocks,
                        int64_t dst_num_blocks, bool same_cache);
// The same against the block counts of the planes; run by every op that reads host ids.
void check_host_ids(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst, const at::Tensor& dst_ids);

// kvcopy::copy_blocks on CPU tensors: coalesced parallel memcpy.
void copy_blocks_cpu_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst, const at::Tensor& dst_ids,
                        int64_t num_ctas);
// kvcopy::copy_blocks_dma on CPU tensors: host memcpy of the same coalesced runs.
void copy_blocks_dma_cpu_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                            const at::Tensor& dst_ids);

#ifdef KVCOPY_WITH_CUDA
// kvcopy::copy_blocks with a CUDA tensor involved: the SM kernel.
void copy_blocks_cuda_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst, const at::Tensor& dst_ids,
                         int64_t num_ctas);
// kvcopy::copy_blocks_dma with a CUDA tensor involved: the copy engines.
void copy_blocks_dma_cuda_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                             const at::Tensor& dst_ids);
#endif

}  // namespace kvcopy
