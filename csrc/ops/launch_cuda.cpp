// The ops' CUDA launchers: kvcopy::copy_blocks (SM kernel) and kvcopy::copy_blocks_dma (copy
// engines) with a CUDA tensor involved, as thin ATen calls: device guard, current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/copy_blocks_dma.h"
#include "../kernels/copy_blocks_sm.h"
#include "aten_planes.h"
#include "ops.h"

namespace kvcopy {
namespace {

// The device all CUDA planes are on (the Python layer rejects two GPUs).
c10::Device cuda_device_of(at::TensorList src, at::TensorList dst) {
  for (const at::Tensor& t : src)
    if (t.is_cuda()) return t.device();
  for (const at::Tensor& t : dst)
    if (t.is_cuda()) return t.device();
  TORCH_CHECK(false, "kvcopy: the CUDA copy needs a CUDA tensor on one side");
}

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear the runtime's pending error, so torch's next check does not report it as its own
  TORCH_CHECK(false, "kvcopy: ", what, " failed: ", cudaGetErrorString(err));
}

}  // namespace

void copy_blocks_cuda_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst, const at::Tensor& dst_ids,
                         int64_t num_ctas) {
  check_id_tensor(src_ids, "src_ids", src_ids.numel());
  check_id_tensor(dst_ids, "dst_ids", src_ids.numel());
  const c10::Device device = cuda_device_of(src, dst);
  TORCH_CHECK(src_ids.device() == device && dst_ids.device() == device, "kvcopy: the SM kernel reads ids on ", device,
              ", got ", src_ids.device(), " and ", dst_ids.device());
  const c10::cuda::CUDAGuard guard(device);
  const std::vector<PlaneCopy> planes = make_plane_table(src, dst);
  check_cuda(copy_blocks_sm(planes.data(), static_cast<int64_t>(planes.size()), src_ids.const_data_ptr<int64_t>(),
                            dst_ids.const_data_ptr<int64_t>(), src_ids.numel(), src.empty() ? 0 : src[0].size(0),
                            dst.empty() ? 0 : dst[0].size(0), static_cast<int>(num_ctas),
                            c10::cuda::getCurrentCUDAStream(device.index()).stream()),
             "block copy kernel launch");
}

void copy_blocks_dma_cuda_op(at::TensorList src, const at::Tensor& src_ids, at::TensorList dst,
                             const at::Tensor& dst_ids) {
  const std::vector<PlaneCopy> planes = make_plane_table(src, dst);
  check_host_ids(src, src_ids, dst, dst_ids);
  const c10::Device device = cuda_device_of(src, dst);
  const c10::cuda::CUDAGuard guard(device);
  check_cuda(copy_blocks_dma(planes.data(), static_cast<int64_t>(planes.size()), src_ids.const_data_ptr<int64_t>(),
                             dst_ids.const_data_ptr<int64_t>(), src_ids.numel(),
                             c10::cuda::getCurrentCUDAStream(device.index()).stream()),
             "copy-engine submission");
}

}  // namespace kvcopy
