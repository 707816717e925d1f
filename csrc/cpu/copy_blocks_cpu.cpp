#include "copy_blocks_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvcopy/copy_ranges.h"

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2 streaming stores: part of every x86-64 CPU, no runtime dispatch
#include <xmmintrin.h>  // _mm_prefetch, _mm_sfence
#define KVCOPY_HAVE_STREAMING_STORES 1
#endif

namespace kvcopy {
namespace {

// Below this many bytes in one call, waking a thread team costs more than it
// saves (a team start is a few microseconds; one core copies ~10 GB/s).
constexpr int64_t kParallelMinBytes = 256 * 1024;

// A planned range is cut into pieces of at most this size so that threads get
// balanced shares even when one range dominates the call.
constexpr int64_t kMaxPieceBytes = 1 << 20;

// Calls moving at least this many bytes write with non-temporal stores. That
// is about half of an EPYC CCX's 32 MiB L3: a destination this large cannot
// stay cached anyway, and skipping the read-for-ownership of each destination
// line cuts memory traffic from 3x to 2x the bytes moved. Smaller calls keep
// ordinary stores, which win while the data is still in cache.
constexpr int64_t kStreamingMinBytes = 16 << 20;

// How far ahead of the loads the streaming loop prefetches: hardware
// prefetchers stop at 4 KiB page boundaries, and a 32 KiB plane-block spans
// eight pages; 1 KiB ahead (16 lines) covers DRAM latency at ~10 GB/s a core.
constexpr int64_t kPrefetchAheadBytes = 1024;

struct CopyPiece {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
};

// The planned ranges, cut into pieces of at most kMaxPieceBytes.
std::vector<CopyPiece> plan_pieces(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                   const int64_t* dst_ids, int64_t num_ids) {
  std::vector<CopyPiece> pieces;
  for (const CopyRange& range : plan_copy_ranges(planes, num_planes, src_ids, dst_ids, num_ids)) {
    for (int64_t off = 0; off < range.nbytes; off += kMaxPieceBytes) {
      pieces.push_back({range.src + off, range.dst + off, std::min(kMaxPieceBytes, range.nbytes - off)});
    }
  }
  return pieces;
}

bool overlaps(const CopyPiece& piece) {
  return piece.dst < piece.src + piece.nbytes && piece.src < piece.dst + piece.nbytes;
}

// Copies one piece; with `streaming`, through non-temporal 16-byte stores
// (the caller fences once after its last piece).
void copy_piece(const CopyPiece& piece, bool streaming) {
#ifdef KVCOPY_HAVE_STREAMING_STORES
  if (streaming && !overlaps(piece)) {
    const uint8_t* src = piece.src;
    uint8_t* dst = piece.dst;
    int64_t left = piece.nbytes;
    const int64_t head = std::min<int64_t>(left, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    std::memcpy(dst, src, head);
    src += head, dst += head, left -= head;
    constexpr int64_t kLine = 64;  // one cache line per iteration: 4 loads, then 4 stores
    for (; left >= kLine; src += kLine, dst += kLine, left -= kLine) {
      _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchAheadBytes, _MM_HINT_T0);
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    std::memcpy(dst, src, left);
    return;
  }
#endif
  (void)streaming;
  std::memmove(piece.dst, piece.src, piece.nbytes);
}

// Touches every 4 KiB page of the next piece's source so that its page walks
// and first DRAM accesses overlap the current piece's copy.
void prefetch_pages(const CopyPiece& piece) {
#ifdef KVCOPY_HAVE_STREAMING_STORES
  constexpr int64_t kPage = 4096;
  for (int64_t off = 0; off < piece.nbytes; off += kPage) {
    _mm_prefetch(reinterpret_cast<const char*>(piece.src) + off, _MM_HINT_T0);
  }
#else
  (void)piece;
#endif
}

// Copies pieces [first, last), announcing each next piece while copying the current one.
void copy_pieces(const std::vector<CopyPiece>& pieces, int64_t first, int64_t last, bool streaming) {
  for (int64_t i = first; i < last; ++i) {
    if (streaming && i + 1 < last) prefetch_pages(pieces[i + 1]);
    copy_piece(pieces[i], streaming);
  }
}

// Makes a thread's non-temporal stores visible before the call returns.
void finish_streaming(bool streaming) {
#ifdef KVCOPY_HAVE_STREAMING_STORES
  if (streaming) _mm_sfence();
#endif
  (void)streaming;
}

}  // namespace

void copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                     int64_t num_ids, int num_threads) {
  if (num_ids <= 0 || num_planes <= 0) return;
  const std::vector<CopyPiece> pieces = plan_pieces(planes, num_planes, src_ids, dst_ids, num_ids);

  int64_t total_bytes = 0;
  for (const CopyPiece& piece : pieces) total_bytes += piece.nbytes;
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  const int threads = total_bytes < kParallelMinBytes ? 1 : std::max(1, num_threads);
  const bool streaming = total_bytes >= kStreamingMinBytes;
  if (threads == 1) {
    copy_pieces(pieces, 0, num_pieces, streaming);
    finish_streaming(streaming);
    return;
  }

  // Thread t copies the pieces whose first byte falls in its equal share of
  // the call's bytes: contiguous, balanced to within one piece.
  std::vector<int64_t> first_piece(threads + 1, num_pieces);
  int64_t seen = 0;
  int t = 0;
  first_piece[0] = 0;
  for (int64_t i = 0; i < num_pieces; ++i) {
    while (t + 1 < threads && seen >= total_bytes * (t + 1) / threads) first_piece[++t] = i;
    seen += pieces[i].nbytes;
  }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int worker = 0; worker < threads; ++worker) {
    copy_pieces(pieces, first_piece[worker], first_piece[worker + 1], streaming);
    finish_streaming(streaming);
  }
}

}  // namespace kvcopy
