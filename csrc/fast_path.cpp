// Eager fast path: the same kernels as the kvcopy ops, entered from Python
// with raw addresses instead of tensor lists.
//
// The dispatcher unboxes every plane of a Tensor[] argument (~0.2 us each, so
// ~25 us for a 64-plane cache). kvcopy's Python layer caches each PagedKV's
// plane table once (kvcopy/plane_table.h) and, in eager mode, calls these
// functions with the tables' addresses. Under torch.compile it calls the
// registered ops instead. Torch-free.
#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/block_copy_cpu.h"
#include "kvcopy/block_ids.h"
#include "kvcopy/copy_ranges.h"
#include "kvcopy/plane_copy.h"
#include "kvcopy/plane_table.h"
#ifdef KVCOPY_WITH_CUDA
#include "kernels/block_copy_cuda.h"
#include "kernels/dma_baselines.h"
#endif

namespace kvcopy {
namespace {

std::vector<PlaneCopy> planes_from_tables(const int64_t* src, const int64_t* dst, int64_t num_planes) {
  std::vector<PlaneCopy> planes(static_cast<size_t>(num_planes));
  for (int64_t p = 0; p < num_planes; ++p) {
    const int64_t* s = src + p * kPlaneTableColumns;
    const int64_t* d = dst + p * kPlaneTableColumns;
    planes[p] = {reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(s[kPlaneAddress])),
                 reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(d[kPlaneAddress])), s[kPlaneBlockStride],
                 d[kPlaneBlockStride], s[kPlaneBlockBytes]};
  }
  return planes;
}

template <typename T>
T* as_ptr(unsigned long long address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// Sets IndexError / ValueError for `problem` and returns false, or returns true when there is none.
bool ids_are_valid(const IdProblem& problem, const IdNames& names, int64_t src_len, int64_t src_blocks,
                   int64_t dst_blocks) {
  if (problem.kind == IdProblem::kNone) return true;
  const std::string message = describe(problem, names, src_len, src_blocks, dst_blocks);
  PyErr_SetString(is_index_problem(problem) ? PyExc_IndexError : PyExc_ValueError, message.c_str());
  return false;
}

// check_block_ids(src_ids, src_len, dst_ids, dst_len, src_num_blocks, dst_num_blocks, same_cache,
//                 src_name, dst_name): IndexError / ValueError naming the argument, or None.
// Host int64 ids; reads them and nothing else.
PyObject* py_check_block_ids(PyObject*, PyObject* args) {
  unsigned long long src_ids, dst_ids;
  long long src_len, dst_len, src_blocks, dst_blocks;
  int same_cache;
  IdNames names;
  if (!PyArg_ParseTuple(args, "KLKLLLpss", &src_ids, &src_len, &dst_ids, &dst_len, &src_blocks, &dst_blocks,
                        &same_cache, &names.src, &names.dst)) {
    return nullptr;
  }
  const IdProblem problem = check_ids(as_ptr<const int64_t>(src_ids), src_len, as_ptr<const int64_t>(dst_ids),
                                      dst_len, src_blocks, dst_blocks, same_cache != 0);
  if (!ids_are_valid(problem, names, src_len, src_blocks, dst_blocks)) return nullptr;
  Py_RETURN_NONE;
}

// Reads positional int arguments of a METH_FASTCALL call: no format string to parse, which is
// most of a small call's cost. Returns false with a Python exception set on a bad argument.
bool read_ints(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t expected, const char* name, long long* out) {
  if (nargs != expected) {
    PyErr_Format(PyExc_TypeError, "%s: expected %zd arguments, got %zd", name, expected, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);  // True/False are ints too
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// copy_blocks_cpu(src_table, dst_table, num_planes, src_ids, src_len, dst_ids, dst_len,
//                 src_num_blocks, dst_num_blocks, same_cache, num_threads)
// Host to host, ids on the host: checks the ids (as check_block_ids, argument names src_ids and
// dst_ids), then copies. Nothing is written when a check fails. Addresses are passed as ints.
PyObject* py_copy_blocks_cpu(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  enum { kSrcTable, kDstTable, kNumPlanes, kSrcIds, kSrcLen, kDstIds, kDstLen, kSrcBlocks, kDstBlocks, kSameCache,
         kNumThreads, kNumArgs };
  long long a[kNumArgs];
  if (!read_ints(args, nargs, kNumArgs, "copy_blocks_cpu", a)) return nullptr;
  const auto* src_ids = as_ptr<const int64_t>(static_cast<unsigned long long>(a[kSrcIds]));
  const auto* dst_ids = as_ptr<const int64_t>(static_cast<unsigned long long>(a[kDstIds]));
  const IdProblem problem =
      check_ids(src_ids, a[kSrcLen], dst_ids, a[kDstLen], a[kSrcBlocks], a[kDstBlocks], a[kSameCache] != 0);
  if (!ids_are_valid(problem, IdNames{}, a[kSrcLen], a[kSrcBlocks], a[kDstBlocks])) return nullptr;
  if (a[kSrcLen] == 0) Py_RETURN_NONE;
  const std::vector<PlaneCopy> planes =
      planes_from_tables(as_ptr<const int64_t>(static_cast<unsigned long long>(a[kSrcTable])),
                         as_ptr<const int64_t>(static_cast<unsigned long long>(a[kDstTable])), a[kNumPlanes]);
  const int num_threads = static_cast<int>(a[kNumThreads]);
  Py_BEGIN_ALLOW_THREADS;
  copy_blocks_cpu(planes.data(), a[kNumPlanes], src_ids, dst_ids, a[kSrcLen], num_threads);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// plan_copy_ranges(src_table, dst_table, num_planes, src_ids, dst_ids, num_ids, for_dma)
//   -> [(src_address, dst_address, nbytes), ...]: the byte ranges the cpu path (for_dma=0) or the
// copy-engine path (for_dma=1: also split at registration chunks) turns this copy into. Ids on the
// host, validated by the caller. Plans only: nothing is read or written.
PyObject* py_plan_copy_ranges(PyObject*, PyObject* args) {
  unsigned long long src_table, dst_table, src_ids, dst_ids;
  long long num_planes, num_ids;
  int for_dma;
  if (!PyArg_ParseTuple(args, "KKLKKLp", &src_table, &dst_table, &num_planes, &src_ids, &dst_ids, &num_ids,
                        &for_dma)) {
    return nullptr;
  }
  const std::vector<PlaneCopy> planes =
      planes_from_tables(as_ptr<const int64_t>(src_table), as_ptr<const int64_t>(dst_table), num_planes);
  std::vector<CopyRange> ranges = plan_copy_ranges(planes.data(), num_planes, as_ptr<const int64_t>(src_ids),
                                                   as_ptr<const int64_t>(dst_ids), num_ids);
  if (for_dma) ranges = split_at_registrations(ranges);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(ranges.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto address = [](const void* p) { return static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)); };
    PyObject* item = Py_BuildValue("(KKL)", address(ranges[i].src), address(ranges[i].dst),
                                   static_cast<long long>(ranges[i].nbytes));
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

#ifdef KVCOPY_WITH_CUDA
PyObject* raise_cuda(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear the runtime's sticky-until-read error, so torch's next check does not report it
  PyErr_Format(PyExc_RuntimeError, "kvcopy: %s failed: %s", what, cudaGetErrorString(err));
  return nullptr;
}

// The Python layer makes the copy's device current (torch.cuda.device); a
// mismatch here would launch on the wrong GPU, so it is an error.
// Returns false with a Python exception set when it is not.
bool device_is_current(int device) {
  int current = -1;
  const cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) {
    raise_cuda(err, "cudaGetDevice");
    return false;
  }
  if (current != device) {
    PyErr_Format(PyExc_RuntimeError, "kvcopy: the current CUDA device is %d, the copy's is %d", current, device);
    return false;
  }
  return true;
}

// copy_blocks_cuda(src_table, dst_table, num_planes, src_ids, dst_ids, num_ids,
//                  src_num_blocks, dst_num_blocks, num_ctas, stream, device); ids on the device.
PyObject* py_copy_blocks_cuda(PyObject*, PyObject* args) {
  unsigned long long src_table, dst_table, src_ids, dst_ids, stream;
  long long num_planes, num_ids, src_blocks, dst_blocks;
  int num_ctas, device;
  if (!PyArg_ParseTuple(args, "KKLKKLLLiKi", &src_table, &dst_table, &num_planes, &src_ids, &dst_ids,
                        &num_ids, &src_blocks, &dst_blocks, &num_ctas, &stream, &device)) {
    return nullptr;
  }
  const std::vector<PlaneCopy> planes =
      planes_from_tables(as_ptr<const int64_t>(src_table), as_ptr<const int64_t>(dst_table), num_planes);
  if (!device_is_current(device)) return nullptr;
  cudaError_t err = cudaSuccess;
  Py_BEGIN_ALLOW_THREADS;  // the launch touches no Python object: other threads run meanwhile
  err = launch_block_copy_kernel(planes.data(), num_planes, as_ptr<const int64_t>(src_ids),
                                 as_ptr<const int64_t>(dst_ids), num_ids, src_blocks, dst_blocks, num_ctas,
                                 as_ptr<CUstream_st>(stream));
  Py_END_ALLOW_THREADS;
  if (err != cudaSuccess) return raise_cuda(err, "block copy kernel launch");
  Py_RETURN_NONE;
}

// copy_blocks_dma(src_table, dst_table, num_planes, src_ids, dst_ids, num_ids, stream, device);
// ids on the host.
PyObject* py_copy_blocks_dma(PyObject*, PyObject* args) {
  unsigned long long src_table, dst_table, src_ids, dst_ids, stream;
  long long num_planes, num_ids;
  int device;
  if (!PyArg_ParseTuple(args, "KKLKKLKi", &src_table, &dst_table, &num_planes, &src_ids, &dst_ids,
                        &num_ids, &stream, &device)) {
    return nullptr;
  }
  const std::vector<PlaneCopy> planes =
      planes_from_tables(as_ptr<const int64_t>(src_table), as_ptr<const int64_t>(dst_table), num_planes);
  if (!device_is_current(device)) return nullptr;
  cudaError_t err = cudaSuccess;
  Py_BEGIN_ALLOW_THREADS;  // planning the ranges and submitting them touch no Python object
  err = submit_block_copy_dma(planes.data(), num_planes, as_ptr<const int64_t>(src_ids),
                              as_ptr<const int64_t>(dst_ids), num_ids, as_ptr<CUstream_st>(stream));
  Py_END_ALLOW_THREADS;
  if (err != cudaSuccess) return raise_cuda(err, "copy-engine submission");
  Py_RETURN_NONE;
}

// copy_blocks_dma_baseline(src_table, dst_table, num_planes, src_ids, dst_ids, num_ids, stream, device,
//                          baseline); ids on the host, validated by the caller. For benchmarks:
// baseline 0 is one cudaMemcpyAsync per (block, plane), 1 one unmerged cudaMemcpyBatchAsync.
PyObject* py_copy_blocks_dma_baseline(PyObject*, PyObject* args) {
  unsigned long long src_table, dst_table, src_ids, dst_ids, stream;
  long long num_planes, num_ids;
  int device, baseline;
  if (!PyArg_ParseTuple(args, "KKLKKLKii", &src_table, &dst_table, &num_planes, &src_ids, &dst_ids,
                        &num_ids, &stream, &device, &baseline)) {
    return nullptr;
  }
  if (baseline != static_cast<int>(DmaBaseline::kPerBlockMemcpy) &&
      baseline != static_cast<int>(DmaBaseline::kUnmergedBatch)) {
    PyErr_Format(PyExc_ValueError, "kvcopy: baseline: expected 0 (per-block memcpy) or 1 (unmerged batch), got %d",
                 baseline);
    return nullptr;
  }
  const std::vector<PlaneCopy> planes =
      planes_from_tables(as_ptr<const int64_t>(src_table), as_ptr<const int64_t>(dst_table), num_planes);
  if (!device_is_current(device)) return nullptr;
  const cudaError_t err = submit_block_copy_dma_baseline(
      planes.data(), num_planes, as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), num_ids,
      static_cast<DmaBaseline>(baseline), as_ptr<CUstream_st>(stream));
  if (err != cudaSuccess) return raise_cuda(err, "baseline copy-engine submission");
  Py_RETURN_NONE;
}

// create_copy_stream(device) -> handle: a stream of the device's least
// priority, non-blocking (no implicit sync with the legacy default stream:
// the engine orders it with events). Owned by the caller: destroy_stream.
PyObject* py_create_copy_stream(PyObject*, PyObject* args) {
  int device;
  if (!PyArg_ParseTuple(args, "i", &device)) return nullptr;
  if (!device_is_current(device)) return nullptr;
  int least = 0, greatest = 0;
  cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (err != cudaSuccess) return raise_cuda(err, "cudaDeviceGetStreamPriorityRange");
  cudaStream_t stream = nullptr;
  err = cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, least);
  if (err != cudaSuccess) return raise_cuda(err, "cudaStreamCreateWithPriority");
  return PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(stream));
}

// can_use_host_pointer(device) -> bool: whether kernels on `device` may read registered
// host memory through its host address (cudaDevAttrCanUseHostPointerForRegisteredMem).
// Where they may not, the SM and Triton kernels cannot reach a HostKVPool.
PyObject* py_can_use_host_pointer(PyObject*, PyObject* args) {
  int device;
  if (!PyArg_ParseTuple(args, "i", &device)) return nullptr;
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, cudaDevAttrCanUseHostPointerForRegisteredMem, device);
  if (err != cudaSuccess) return raise_cuda(err, "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)");
  return PyBool_FromLong(value);
}

// cuda_driver_version() -> int, e.g. 13000 for a CUDA 13.0 driver (0 without one): for machine identities.
PyObject* py_cuda_driver_version(PyObject*, PyObject*) {
  int version = 0;
  const cudaError_t err = cudaDriverGetVersion(&version);
  if (err != cudaSuccess) return raise_cuda(err, "cudaDriverGetVersion");
  return PyLong_FromLong(version);
}

// sm_kernel_grid(num_items, num_planes, num_ctas) -> int: the CTAs the SM kernel launches with
// on the current device (num_ctas <= 0: one wave of the CTAs resident at once).
PyObject* py_sm_kernel_grid(PyObject*, PyObject* args) {
  long long num_items, num_planes;
  int requested;
  if (!PyArg_ParseTuple(args, "LLi", &num_items, &num_planes, &requested)) return nullptr;
  int grid = 0;
  const cudaError_t err = block_copy_grid(num_items, num_planes, requested, &grid);
  if (err != cudaSuccess) return raise_cuda(err, "sizing the SM kernel's grid");
  return PyLong_FromLong(grid);
}

// dma_side_streams_alive() -> int: side streams held for threads that used the copy engines on the
// legacy default stream (each is destroyed when its thread exits).
PyObject* py_dma_side_streams_alive(PyObject*, PyObject*) {
  return PyLong_FromLongLong(static_cast<long long>(dma_side_streams_alive()));
}

// stream_is_capturing(handle) -> bool: whether the stream is capturing a CUDA graph now
// (cudaStreamIsCapturing, which is legal during any capture); False for a stream that no
// longer exists.
PyObject* py_stream_is_capturing(PyObject*, PyObject* args) {
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "K", &stream)) return nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(as_ptr<CUstream_st>(stream), &status) != cudaSuccess) {
    cudaGetLastError();  // a stream destroyed since: it captures nothing
    Py_RETURN_FALSE;
  }
  return PyBool_FromLong(status == cudaStreamCaptureStatusActive);
}

// destroy_stream(handle): after the caller has waited for its work.
PyObject* py_destroy_stream(PyObject*, PyObject* args) {
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "K", &stream)) return nullptr;
  const cudaError_t err = cudaStreamDestroy(as_ptr<CUstream_st>(stream));
  if (err != cudaSuccess) return raise_cuda(err, "cudaStreamDestroy");
  Py_RETURN_NONE;
}
#endif

}  // namespace

PyMethodDef kFastPathMethods[] = {
    {"check_block_ids", py_check_block_ids, METH_VARARGS, "Checks host ids: range, repeats, read and written."},
    {"copy_blocks_cpu", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_copy_blocks_cpu)),
     METH_FASTCALL, "Checked CPU block copy from plane-table addresses."},
    {"plan_copy_ranges", py_plan_copy_ranges, METH_VARARGS, "The byte ranges a copy becomes (plans only)."},
#ifdef KVCOPY_WITH_CUDA
    {"copy_blocks_cuda", py_copy_blocks_cuda, METH_VARARGS, "SM-kernel block copy from plane-table addresses."},
    {"copy_blocks_dma", py_copy_blocks_dma, METH_VARARGS, "Copy-engine block copy from plane-table addresses."},
    {"copy_blocks_dma_baseline", py_copy_blocks_dma_baseline, METH_VARARGS,
     "Benchmark baselines: per-block cudaMemcpyAsync (0) or one unmerged cudaMemcpyBatchAsync (1)."},
    {"create_copy_stream", py_create_copy_stream, METH_VARARGS, "A new least-priority non-blocking stream."},
    {"can_use_host_pointer", py_can_use_host_pointer, METH_VARARGS,
     "Whether kernels on the device may read registered host memory by its host address."},
    {"cuda_driver_version", py_cuda_driver_version, METH_NOARGS, "The CUDA driver's version (cudaDriverGetVersion)."},
    {"sm_kernel_grid", py_sm_kernel_grid, METH_VARARGS, "The SM kernel's grid for a launch (tests)."},
    {"dma_side_streams_alive", py_dma_side_streams_alive, METH_NOARGS, "Side streams held for threads (tests)."},
    {"stream_is_capturing", py_stream_is_capturing, METH_VARARGS, "Whether a stream is capturing a graph now."},
    {"destroy_stream", py_destroy_stream, METH_VARARGS, "Destroys a stream made by create_copy_stream."},
#endif
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace kvcopy
