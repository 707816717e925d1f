// CUDA errors as Python exceptions for the pybind11 entry points: pybind11
// raises a std::runtime_error as RuntimeError. Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace kvcopy {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear the runtime's sticky-until-read error, so torch's next check does not report it
  throw std::runtime_error(std::string("kvcopy: ") + what + " failed: " + cudaGetErrorString(err));
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw_cuda(err, what);
}

// The Python layer makes the copy's device current (torch.cuda.device); a mismatch here would
// launch on the wrong GPU, so it is an error.
inline void check_device_is_current(int device) {
  int current = -1;
  check_cuda(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) {
    throw std::runtime_error("kvcopy: the current CUDA device is " + std::to_string(current) + ", the copy's is " +
                             std::to_string(device));
  }
}

}  // namespace kvcopy
