// Submitting byte ranges to the copy engines (dma_submit.h): one by one, or in one batch
// (through a side stream on the legacy default stream). Torch-free host code.
#include "dma_submit.h"

#include <atomic>
#include <unordered_map>
#include <vector>

#include "kvcopy/copy_ranges.h"

namespace kvcopy {
namespace {

// Side streams alive (ThreadSideStreams below); stays 0 where the batched call is not compiled in.
std::atomic<int64_t> g_side_streams_alive{0};

struct DmaCopies {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

DmaCopies plan_dma(const std::vector<CopyRange>& ranges) {
  DmaCopies copies;
  copies.srcs.reserve(ranges.size());
  copies.dsts.reserve(ranges.size());
  copies.sizes.reserve(ranges.size());
  for (const CopyRange& range : ranges) {
    copies.srcs.push_back(range.src);
    copies.dsts.push_back(range.dst);
    copies.sizes.push_back(static_cast<size_t>(range.nbytes));
  }
  return copies;
}

cudaError_t submit_one_by_one(const DmaCopies& copies, cudaStream_t stream) {
  for (size_t i = 0; i < copies.sizes.size(); ++i) {
    const cudaError_t err = cudaMemcpyAsync(copies.dsts[i], copies.srcs[i], copies.sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#if CUDART_VERSION >= 12080
cudaError_t submit_batch(DmaCopies& copies, cudaStream_t stream) {
  // Sources are read in stream order: earlier work on the stream may write them.
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attrs_index = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(copies.dsts.data(), copies.srcs.data(), copies.sizes.data(), copies.sizes.size(), &attrs,
                              &attrs_index, 1, stream);
#else
  size_t fail_index = 0;
  return cudaMemcpyBatchAsync(copies.dsts.data(), const_cast<void**>(copies.srcs.data()), copies.sizes.data(),
                              copies.sizes.size(), &attrs, &attrs_index, 1, &fail_index, stream);
#endif
}

// The batched call refuses the legacy default stream, which is torch's
// default. There the batch goes to a side stream of this host thread, ordered
// both ways with events, so it behaves as if it ran on the legacy stream.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t before = nullptr;  // recorded on the caller's stream, waited on by the side stream
  cudaEvent_t after = nullptr;   // recorded on the side stream, waited on by the caller's stream
};

// One side stream and two events per device that this host thread used the path on, destroyed
// when the thread exits (CUDA releases a destroyed stream once its queued work is done; at
// process exit the driver may be gone already, and what it answers then is ignored).
struct ThreadSideStreams {
  std::unordered_map<int, SideStream> by_device;
  ~ThreadSideStreams() {
    for (auto& entry : by_device) {
      const SideStream& side = entry.second;
      if (side.before != nullptr) cudaEventDestroy(side.before);
      if (side.after != nullptr) cudaEventDestroy(side.after);
      if (side.stream != nullptr) {
        cudaStreamDestroy(side.stream);
        --g_side_streams_alive;
      }
    }
    cudaGetLastError();
  }
};

cudaError_t side_stream_for_current_device(SideStream** out) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  thread_local ThreadSideStreams side_streams;
  SideStream& side = side_streams.by_device[device];
  if (side.stream == nullptr) {
    if ((err = cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (err = cudaEventCreateWithFlags(&side.before, cudaEventDisableTiming)) != cudaSuccess ||
        (err = cudaEventCreateWithFlags(&side.after, cudaEventDisableTiming)) != cudaSuccess) {
      side = SideStream{};
      return err;
    }
    ++g_side_streams_alive;
  }
  *out = &side;
  return cudaSuccess;
}

cudaError_t submit_batch_via_side_stream(DmaCopies& copies, cudaStream_t stream) {
  SideStream* side = nullptr;
  cudaError_t err = side_stream_for_current_device(&side);
  if (err != cudaSuccess) return err;
  if ((err = cudaEventRecord(side->before, stream)) != cudaSuccess) return err;
  if ((err = cudaStreamWaitEvent(side->stream, side->before, 0)) != cudaSuccess) return err;
  if ((err = submit_batch(copies, side->stream)) != cudaSuccess) return err;
  if ((err = cudaEventRecord(side->after, side->stream)) != cudaSuccess) return err;
  return cudaStreamWaitEvent(stream, side->after, 0);
}

bool is_legacy_stream(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }
#endif

// All copies in one cudaMemcpyBatchAsync where the runtime has it (CUDA 12.8+), else one call each.
cudaError_t submit_batched(DmaCopies& copies, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  if (copies.sizes.size() > 1) {
    return is_legacy_stream(stream) ? submit_batch_via_side_stream(copies, stream) : submit_batch(copies, stream);
  }
#endif
  return submit_one_by_one(copies, stream);
}

}  // namespace

int64_t dma_side_streams_alive() { return g_side_streams_alive.load(); }

cudaError_t submit_copy_ranges(const std::vector<CopyRange>& ranges, bool batched, cudaStream_t stream) {
  if (ranges.empty()) return cudaSuccess;
  DmaCopies copies = plan_dma(split_at_registrations(ranges));
  return batched ? submit_batched(copies, stream) : submit_one_by_one(copies, stream);
}

}  // namespace kvcopy
