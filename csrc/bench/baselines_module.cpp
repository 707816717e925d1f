// The Python module kvcopy.tools.bench._baselines, bound with pybind11: the
// benchmark's copy-engine baselines (dma_baselines.h), timed beside kvcopy's
// copies by kvcopy/tools/bench/baselines.py. They are no part of the copy
// core, so kvcopy._C does not hold them; setup.py builds this module beside it
// only with the CUDA kernels. Torch-free, like python/module.cpp.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dma_baselines.h"
#include "kvcopy/plane_copy.h"
#include "python/cuda_checks.h"
#include "python/plane_tables.h"

namespace py = pybind11;

namespace kvcopy {
namespace {

// Baseline 0 is one cudaMemcpyAsync per (block, plane), 1 one unmerged cudaMemcpyBatchAsync. Ids on
// the host, validated by the caller (the benchmark makes them).
void py_copy_blocks_dma_baseline(Address src_table, Address dst_table, int64_t num_planes, Address src_ids,
                                 Address dst_ids, int64_t num_ids, Address stream, int device, int baseline) {
  if (baseline != static_cast<int>(DmaBaseline::kPerBlockMemcpy) &&
      baseline != static_cast<int>(DmaBaseline::kUnmergedBatch)) {
    throw py::value_error("kvcopy: baseline: expected 0 (per-block memcpy) or 1 (unmerged batch), got " +
                          std::to_string(baseline));
  }
  const std::vector<PlaneCopy> planes = planes_from_tables(src_table, dst_table, num_planes);
  check_device_is_current(device);
  check_cuda(copy_blocks_dma_baseline(planes.data(), num_planes, as_ptr<const int64_t>(src_ids),
                                      as_ptr<const int64_t>(dst_ids), num_ids, static_cast<DmaBaseline>(baseline),
                                      as_ptr<CUstream_st>(stream)),
             "baseline copy-engine submission");
}

}  // namespace
}  // namespace kvcopy

PYBIND11_MODULE(_baselines, m) {
  using namespace kvcopy;
  m.doc() = "kvcopy's benchmark baselines for the copy engines (not used by kvcopy's copies)";
  m.def("copy_blocks_dma_baseline", &py_copy_blocks_dma_baseline,
        "Benchmark baselines: per-block cudaMemcpyAsync (0) or one unmerged cudaMemcpyBatchAsync (1).");
}
