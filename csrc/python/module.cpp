// The whole Python module kvcopy._C, bound with pybind11: the eager entry
// points into the same kernels as the kvcopy ops, entered with raw addresses
// instead of tensor lists; HostCopyPlan, the host fast path's compiled side;
// and the CUDA helpers the Python layer needs. Torch-free:
// pybind11 is used directly (the copy torch ships), not through torch's
// extension header, so this file compiles in seconds.
//
// Why addresses: the dispatcher unboxes every plane of a Tensor[] argument
// (~0.2 us each, so 15-25 us for a 64-plane cache). kvcopy's Python layer
// caches each PagedKV's plane table once (kvcopy/plane_table.h) and, in eager
// mode, calls these functions with the tables' addresses. Under torch.compile
// it calls the registered ops (csrc/ops/registration.cpp) instead.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/copy_blocks_cpu.h"
#include "kvcopy/block_ids.h"
#include "kvcopy/copy_ranges.h"
#include "kvcopy/plane_copy.h"
#include "kvcopy/plane_table.h"
#include "plane_tables.h"
#ifdef KVCOPY_WITH_CUDA
#include "cuda_checks.h"
#include "kernels/copy_blocks_dma.h"
#include "kernels/copy_blocks_sm.h"
#include "kernels/dma_submit.h"
#endif

namespace py = pybind11;

namespace kvcopy {
namespace {

// Throws `problem` (unless kNone) as IndexError / ValueError, worded as the Python checks and the ops word it.
void throw_if_invalid(const IdProblem& problem, const IdNames& names, int64_t src_len, int64_t src_blocks,
                      int64_t dst_blocks) {
  if (problem.kind == IdProblem::kNone) return;
  const std::string message = describe(problem, names, src_len, src_blocks, dst_blocks);
  if (is_index_problem(problem)) throw py::index_error(message);
  throw py::value_error(message);
}

// Throws IndexError / ValueError unless the host ids are valid.
void check_host_ids(Address src_ids, int64_t src_len, Address dst_ids, int64_t dst_len, int64_t src_blocks,
                    int64_t dst_blocks, bool same_cache, const IdNames& names) {
  throw_if_invalid(check_ids(as_ptr<const int64_t>(src_ids), src_len, as_ptr<const int64_t>(dst_ids), dst_len,
                             src_blocks, dst_blocks, same_cache),
                   names, src_len, src_blocks, dst_blocks);
}

// A host-to-host (src, dst) pair resolved once: its planes, block counts and whether both sides are
// one cache. kvcopy.dispatch keeps one per pair it has seen, valid while both caches are alive.
class HostCopyPlan {
 public:
  HostCopyPlan(Address src_table, Address dst_table, int64_t num_planes, int64_t src_blocks, int64_t dst_blocks,
               bool same_cache)
      : planes_(planes_from_tables(src_table, dst_table, num_planes)),
        src_blocks_(src_blocks),
        dst_blocks_(dst_blocks),
        same_cache_(same_cache) {}

  // Checks the ids (argument names src_ids and dst_ids), then copies without the GIL. Nothing is
  // written when a check fails.
  void copy(Address src_ids, int64_t src_len, Address dst_ids, int64_t dst_len, int num_threads) const {
    check_host_ids(src_ids, src_len, dst_ids, dst_len, src_blocks_, dst_blocks_, same_cache_, IdNames{});
    if (src_len == 0) return;
    py::gil_scoped_release release;
    copy_blocks_cpu(planes_.data(), static_cast<int64_t>(planes_.size()), as_ptr<const int64_t>(src_ids),
                    as_ptr<const int64_t>(dst_ids), src_len, num_threads);
  }

 private:
  std::vector<PlaneCopy> planes_;
  int64_t src_blocks_;
  int64_t dst_blocks_;
  bool same_cache_;
};

// The byte ranges the cpu path (for_dma false) or the copy-engine path (for_dma: also split at
// registration chunks) turns a copy into. Ids on the host, validated by the caller. Plans only.
std::vector<std::tuple<Address, Address, int64_t>> py_plan_copy_ranges(Address src_table, Address dst_table,
                                                                       int64_t num_planes, Address src_ids,
                                                                       Address dst_ids, int64_t num_ids, bool for_dma) {
  const std::vector<PlaneCopy> planes = planes_from_tables(src_table, dst_table, num_planes);
  std::vector<CopyRange> ranges = plan_copy_ranges(planes.data(), num_planes, as_ptr<const int64_t>(src_ids),
                                                   as_ptr<const int64_t>(dst_ids), num_ids);
  if (for_dma) ranges = split_at_registrations(ranges);
  std::vector<std::tuple<Address, Address, int64_t>> out;
  out.reserve(ranges.size());
  for (const CopyRange& range : ranges) {
    out.emplace_back(reinterpret_cast<Address>(range.src), reinterpret_cast<Address>(range.dst), range.nbytes);
  }
  return out;
}

// The CPU path's plan of a copy, as copy_blocks_cpu would copy it (tests): its pieces as (source address,
// destination address, bytes) in copy order, the first piece of each thread (and the end), whether it
// streams and whether it took the ids in source order. Ids on the host, validated by the caller. Plans only.
std::tuple<std::vector<std::tuple<Address, Address, int64_t>>, std::vector<int64_t>, bool, bool>
py_plan_copy_blocks_cpu(Address src_table, Address dst_table, int64_t num_planes, Address src_ids, Address dst_ids,
                        int64_t num_ids, int num_threads) {
  const std::vector<PlaneCopy> planes = planes_from_tables(src_table, dst_table, num_planes);
  const CpuCopyPlan plan = plan_copy_blocks_cpu(planes.data(), num_planes, as_ptr<const int64_t>(src_ids),
                                                as_ptr<const int64_t>(dst_ids), num_ids, num_threads);
  std::vector<std::tuple<Address, Address, int64_t>> pieces;
  pieces.reserve(plan.pieces.size());
  for (const CopyPiece& piece : plan.pieces) {
    pieces.emplace_back(reinterpret_cast<Address>(piece.src), reinterpret_cast<Address>(piece.dst), piece.nbytes);
  }
  return {std::move(pieces), plan.first_piece, plan.streaming, plan.source_order};
}

#ifdef KVCOPY_WITH_CUDA
// SM kernel; ids on the device.
void py_copy_blocks_cuda(Address src_table, Address dst_table, int64_t num_planes, Address src_ids, Address dst_ids,
                         int64_t num_ids, int64_t src_blocks, int64_t dst_blocks, int num_ctas, Address stream,
                         int device) {
  const std::vector<PlaneCopy> planes = planes_from_tables(src_table, dst_table, num_planes);
  check_device_is_current(device);
  cudaError_t err = cudaSuccess;
  {
    py::gil_scoped_release release;  // the launch touches no Python object: other threads run meanwhile
    err = copy_blocks_sm(planes.data(), num_planes, as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids),
                         num_ids, src_blocks, dst_blocks, num_ctas, as_ptr<CUstream_st>(stream));
  }
  check_cuda(err, "block copy kernel launch");
}

// Copy engines; ids on the host, validated by the caller.
void py_copy_blocks_dma(Address src_table, Address dst_table, int64_t num_planes, Address src_ids, Address dst_ids,
                        int64_t num_ids, Address stream, int device) {
  const std::vector<PlaneCopy> planes = planes_from_tables(src_table, dst_table, num_planes);
  check_device_is_current(device);
  cudaError_t err = cudaSuccess;
  {
    py::gil_scoped_release release;  // planning the ranges and submitting them touch no Python object
    err = copy_blocks_dma(planes.data(), num_planes, as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids),
                          num_ids, as_ptr<CUstream_st>(stream));
  }
  check_cuda(err, "copy-engine submission");
}

// A stream of the device's least priority, non-blocking (no implicit sync with the legacy default
// stream: the engine orders it with events). Owned by the caller: destroy_stream.
Address py_create_copy_stream(int device) {
  check_device_is_current(device);
  int least = 0, greatest = 0;
  check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, least), "cudaStreamCreateWithPriority");
  return reinterpret_cast<Address>(stream);
}

// Whether kernels on `device` may read registered host memory through its host address
// (cudaDevAttrCanUseHostPointerForRegisteredMem); where they may not, the SM and Triton kernels
// cannot reach a HostKVPool.
bool py_can_use_host_pointer(int device) {
  int value = 0;
  check_cuda(cudaDeviceGetAttribute(&value, cudaDevAttrCanUseHostPointerForRegisteredMem, device),
             "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)");
  return value != 0;
}

int py_cuda_driver_version() {
  int version = 0;
  check_cuda(cudaDriverGetVersion(&version), "cudaDriverGetVersion");
  return version;
}

int py_sm_kernel_grid(int64_t num_items, int64_t num_planes, int requested) {
  int grid = 0;
  check_cuda(copy_blocks_sm_grid(num_items, num_planes, requested, &grid), "sizing the SM kernel's grid");
  return grid;
}

// Whether the stream is capturing a CUDA graph now (cudaStreamIsCapturing, legal during any
// capture); false for a stream that no longer exists.
bool py_stream_is_capturing(Address stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(as_ptr<CUstream_st>(stream), &status) != cudaSuccess) {
    cudaGetLastError();  // a stream destroyed since: it captures nothing
    return false;
  }
  return status == cudaStreamCaptureStatusActive;
}

void py_destroy_stream(Address stream) {
  check_cuda(cudaStreamDestroy(as_ptr<CUstream_st>(stream)), "cudaStreamDestroy");
}
#endif

}  // namespace
}  // namespace kvcopy

// Importing the module also runs the op registrations of csrc/ops/registration.cpp (same library).
// Which CUDA archs were built is recorded by setup.py in kvcopy/_build_config.json.
PYBIND11_MODULE(_C, m) {
  using namespace kvcopy;
  m.doc() = "kvcopy's compiled ops and eager fast path";
#ifdef KVCOPY_WITH_CUDA
  m.attr("WITH_CUDA") = 1;
#else
  m.attr("WITH_CUDA") = 0;
#endif
  m.attr("COMPILER") = __VERSION__;
  m.attr("PLANE_TABLE_COLUMNS") = static_cast<int64_t>(kPlaneTableColumns);

  py::class_<HostCopyPlan>(m, "HostCopyPlan", "A host-to-host pair's planes, resolved once.")
      .def(py::init<Address, Address, int64_t, int64_t, int64_t, bool>(), py::arg("src_table"), py::arg("dst_table"),
           py::arg("num_planes"), py::arg("src_num_blocks"), py::arg("dst_num_blocks"), py::arg("same_cache"))
      .def("copy", &HostCopyPlan::copy, "Checks host ids, then copies them.", py::arg("src_ids"), py::arg("src_len"),
           py::arg("dst_ids"), py::arg("dst_len"), py::arg("num_threads"));
  m.def(
      "check_block_ids",
      [](Address src_ids, int64_t src_len, Address dst_ids, int64_t dst_len, int64_t src_blocks, int64_t dst_blocks,
         bool same_cache, const std::string& src_name, const std::string& dst_name) {
        check_host_ids(src_ids, src_len, dst_ids, dst_len, src_blocks, dst_blocks, same_cache,
                       IdNames{src_name.c_str(), dst_name.c_str()});
      },
      "Checks host ids: range, repeats, a block read and written; IndexError / ValueError naming the argument.");
  m.def(
      "check_block_id_side",
      [](Address ids, int64_t len, int64_t num_blocks, bool destination, const std::string& name) {
        throw_if_invalid(check_id_side(as_ptr<const int64_t>(ids), len, num_blocks, destination),
                         IdNames{name.c_str(), name.c_str()}, len, num_blocks, num_blocks);
      },
      "Checks one side's host ids: range, and for a destination repeats.");
  m.def(
      "copy_blocks_cpu",
      [](Address src_table, Address dst_table, int64_t num_planes, Address src_ids, int64_t src_len, Address dst_ids,
         int64_t dst_len, int64_t src_blocks, int64_t dst_blocks, bool same_cache, int num_threads) {
        HostCopyPlan(src_table, dst_table, num_planes, src_blocks, dst_blocks, same_cache)
            .copy(src_ids, src_len, dst_ids, dst_len, num_threads);
      },
      "Checked CPU block copy from plane-table addresses.");
  m.def("plan_copy_ranges", &py_plan_copy_ranges, "The byte ranges a copy becomes (plans only).");
  m.def("plan_copy_blocks_cpu", &py_plan_copy_blocks_cpu,
        "The CPU path's plan of a copy: pieces in copy order, threads' shares, streaming, source order (tests).");
#ifdef KVCOPY_WITH_CUDA
  m.def("copy_blocks_cuda", &py_copy_blocks_cuda, "SM-kernel block copy from plane-table addresses.");
  m.def("copy_blocks_dma", &py_copy_blocks_dma, "Copy-engine block copy from plane-table addresses.");
  m.def("create_copy_stream", &py_create_copy_stream, "A new least-priority non-blocking stream.");
  m.def("can_use_host_pointer", &py_can_use_host_pointer,
        "Whether kernels on the device may read registered host memory by its host address.");
  m.def("cuda_driver_version", &py_cuda_driver_version, "The CUDA driver's version (cudaDriverGetVersion).");
  m.def("sm_kernel_grid", &py_sm_kernel_grid, "The SM kernel's grid for a launch (tests).");
  m.def("dma_side_streams_alive", &dma_side_streams_alive, "Side streams held for threads (tests).");
  m.def("stream_is_capturing", &py_stream_is_capturing, "Whether a stream is capturing a graph now.");
  m.def("destroy_stream", &py_destroy_stream, "Destroys a stream made by create_copy_stream.");
#endif
}
