#include "copy_blocks_cpu.h"

#include <algorithm>
#include <cstring>
#include <numeric>
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

// Calls moving at least this many bytes take the streaming path: non-temporal
// stores, the source prefetched ahead (SourceLookahead), the ids in source
// order (sort_by_source). That is about half of an EPYC CCX's 32 MiB L3: a
// destination this large cannot stay cached anyway, and skipping the
// read-for-ownership of each destination line cuts memory traffic from 3x to 2x
// the bytes moved. Smaller calls keep ordinary stores, which win while the data
// is still in cache.
constexpr int64_t kStreamingMinBytes = 16 << 20;

// How far ahead of the copy the streaming path prefetches each source line, in
// bytes of the thread's own pieces in copy order. The prefetches run on from one
// piece into the next, so a small piece's first lines are in flight before its
// copy starts, and none fall past a piece's end (1 KiB ahead inside each piece,
// as before, also read the 1 KiB after every 8 KiB piece, which no copy wants).
// On the 2-core AMD EPYC VM a dependent read of a random 4 KiB page of a 4 GiB
// cache took 0.7-0.8 us (a nested page walk, then DRAM) while one core copies
// ~20 GB/s: 1 KiB ahead left most of each piece's first miss exposed. With the
// page touches and the source order below, 4, 8 and 16 KiB ahead measured alike
// there (one core gathering 8 KiB plane-blocks: 0.69-0.74x memcpy, against 0.54x
// before); 8 KiB is the middle.
constexpr int64_t kPrefetchAheadBytes = 8 * 1024;

// How far ahead the streaming path touches each 4 KiB page of the source once,
// so that its page walk is done when the line prefetches reach it. On the EPYC
// VM this raised one core gathering 8 KiB plane-blocks from 0.64x to 0.71x
// memcpy; 32, 64 and 128 KiB measured alike. (With the source in 2 MiB pages the
// same gather ran at 0.91x: page walks are what 4 KiB pages still cost.)
constexpr int64_t kTranslateAheadBytes = 64 * 1024;

#ifdef KVCOPY_HAVE_STREAMING_STORES
constexpr int64_t kCacheLineBytes = 64;

// The cache lines that hold some byte of [src, src + nbytes), nbytes > 0.
int64_t lines_spanned(const uint8_t* src, int64_t nbytes) {
  const auto first = reinterpret_cast<uintptr_t>(src) / kCacheLineBytes;
  const auto last = (reinterpret_cast<uintptr_t>(src) + nbytes - 1) / kCacheLineBytes;
  return static_cast<int64_t>(last - first) + 1;
}

// Prefetches one thread's source ahead of its copy of pieces [first, last) in copy order:
// - step(), called once for every source line the copy reads, prefetches the line
//   kPrefetchAheadBytes ahead, running on from one piece into the next;
// - entering(piece), called as the copy starts each piece, touches each 4 KiB page of
//   the pieces up to kTranslateAheadBytes ahead once, so that their page walks are done
//   when the line prefetches reach them.
class SourceLookahead {
 public:
  SourceLookahead(const CopyPiece* first, const CopyPiece* last) : last_(last), line_piece_(first), page_piece_(first) {
    for (int64_t i = 0; i < kPrefetchAheadBytes / kCacheLineBytes; ++i) step();
  }

  void step() {
    if (line_ == line_end_ && !enter(line_piece_)) return;
    _mm_prefetch(reinterpret_cast<const char*>(line_), _MM_HINT_T0);
    line_ += kCacheLineBytes;
  }

  void entering(const CopyPiece& piece) {
    copy_bytes_ += piece.nbytes;
    for (; page_piece_ != last_ && touched_bytes_ < copy_bytes_ + kTranslateAheadBytes; ++page_piece_) {
      const auto* src = reinterpret_cast<const char*>(page_piece_->src);
      for (int64_t off = 0; off < page_piece_->nbytes; off += kPageBytes) _mm_prefetch(src + off, _MM_HINT_T0);
      if (page_piece_->nbytes > 0) _mm_prefetch(src + page_piece_->nbytes - 1, _MM_HINT_T0);  // its last page
      touched_bytes_ += page_piece_->nbytes;
    }
  }

 private:
  static constexpr int64_t kPageBytes = 4096;  // the smallest x86-64 page: a new translation at least this often

  // Starts prefetching the lines of the next non-empty piece from `piece` on.
  bool enter(const CopyPiece*& piece) {
    for (; piece != last_; ++piece) {
      if (piece->nbytes <= 0) continue;
      line_ = piece->src - reinterpret_cast<uintptr_t>(piece->src) % kCacheLineBytes;  // the line of its first byte
      line_end_ = line_ + lines_spanned(piece->src, piece->nbytes) * kCacheLineBytes;
      ++piece;
      return true;
    }
    return false;
  }

  const CopyPiece* last_;
  const CopyPiece* line_piece_;        // the next piece whose lines are prefetched
  const uint8_t* line_ = nullptr;      // the next line to prefetch
  const uint8_t* line_end_ = nullptr;  // past the last line of its piece
  const CopyPiece* page_piece_;        // the next piece whose pages are touched
  int64_t copy_bytes_ = 0;             // bytes of the pieces the copy has entered
  int64_t touched_bytes_ = 0;          // bytes of the pieces whose pages are touched
};
#endif

bool overlaps(const CopyPiece& piece) {
  return piece.dst < piece.src + piece.nbytes && piece.src < piece.dst + piece.nbytes;
}

#ifdef KVCOPY_HAVE_STREAMING_STORES
// Copies one piece through non-temporal 16-byte stores, stepping `lookahead` once for
// every source line (the caller fences once after its last piece).
void stream_piece(const CopyPiece& piece, SourceLookahead& lookahead) {
  if (piece.nbytes <= 0) return;
  lookahead.entering(piece);
  int64_t steps_left = lines_spanned(piece.src, piece.nbytes);
  if (overlaps(piece)) {
    std::memmove(piece.dst, piece.src, piece.nbytes);
  } else {
    const uint8_t* src = piece.src;
    uint8_t* dst = piece.dst;
    int64_t left = piece.nbytes;
    const int64_t head = std::min<int64_t>(left, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    std::memcpy(dst, src, head);
    src += head, dst += head, left -= head;
    steps_left -= left / kCacheLineBytes;
    for (; left >= kCacheLineBytes; src += kCacheLineBytes, dst += kCacheLineBytes, left -= kCacheLineBytes) {
      lookahead.step();  // one cache line per iteration: 4 loads, then 4 stores
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
  }
  for (; steps_left > 0; --steps_left) lookahead.step();  // the lines the loop did not step for: head and tail
}
#endif

// Copies pieces [first, last); `streaming`: through stream_piece, then one fence
// that makes the thread's non-temporal stores visible before the call returns.
void copy_pieces(const CopyPiece* first, const CopyPiece* last, bool streaming) {
#ifdef KVCOPY_HAVE_STREAMING_STORES
  if (streaming) {
    SourceLookahead lookahead(first, last);
    for (const CopyPiece* piece = first; piece != last; ++piece) stream_piece(*piece, lookahead);
    _mm_sfence();
    return;
  }
#endif
  (void)streaming;
  for (const CopyPiece* piece = first; piece != last; ++piece) std::memmove(piece->dst, piece->src, piece->nbytes);
}

// The (src, dst) id pairs in ascending order of source block (stable: a source
// read twice keeps its destinations' order). Taken in this order, a gather of
// random blocks reads each plane front to back: neighbouring blocks' page walks
// share cache lines of the page tables, and DRAM rows are reopened less often.
// On the 2-core AMD EPYC VM this raised one core gathering 8 KiB plane-blocks
// from 0.67x to 0.71x memcpy. The stores are not waited for, so the
// destination's order matters less.
void sort_by_source(const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids, std::vector<int64_t>& sorted_src,
                    std::vector<int64_t>& sorted_dst) {
  std::vector<int64_t> order(static_cast<size_t>(num_ids));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return src_ids[a] < src_ids[b]; });
  sorted_src.resize(order.size());
  sorted_dst.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    sorted_src[i] = src_ids[order[i]];
    sorted_dst[i] = dst_ids[order[i]];
  }
}

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

}  // namespace

CpuCopyPlan plan_copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                                 const int64_t* dst_ids, int64_t num_ids, int num_threads) {
  CpuCopyPlan plan;
  if (num_ids <= 0 || num_planes <= 0) {
    plan.first_piece = {0, 0};
    return plan;
  }
  int64_t block_bytes = 0;  // every plane of one block
  for (int64_t p = 0; p < num_planes; ++p) block_bytes += planes[p].nbytes;
  plan.total_bytes = block_bytes * num_ids;
  plan.streaming = plan.total_bytes >= kStreamingMinBytes;
  plan.source_order = plan.streaming && !std::is_sorted(src_ids, src_ids + num_ids);
  if (plan.source_order) {
    std::vector<int64_t> sorted_src, sorted_dst;
    sort_by_source(src_ids, dst_ids, num_ids, sorted_src, sorted_dst);
    plan.pieces = plan_pieces(planes, num_planes, sorted_src.data(), sorted_dst.data(), num_ids);
  } else {
    plan.pieces = plan_pieces(planes, num_planes, src_ids, dst_ids, num_ids);
  }

  // Thread t copies the pieces whose first byte falls in its equal share of
  // the call's bytes: contiguous, balanced to within one piece.
  const int threads = plan.total_bytes < kParallelMinBytes ? 1 : std::max(1, num_threads);
  const int64_t num_pieces = static_cast<int64_t>(plan.pieces.size());
  plan.first_piece.assign(threads + 1, num_pieces);
  plan.first_piece[0] = 0;
  int64_t seen = 0;
  int t = 0;
  for (int64_t i = 0; i < num_pieces; ++i) {
    while (t + 1 < threads && seen >= plan.total_bytes * (t + 1) / threads) plan.first_piece[++t] = i;
    seen += plan.pieces[i].nbytes;
  }
  return plan;
}

void copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids, const int64_t* dst_ids,
                     int64_t num_ids, int num_threads) {
  if (num_ids <= 0 || num_planes <= 0) return;
  const CpuCopyPlan plan = plan_copy_blocks_cpu(planes, num_planes, src_ids, dst_ids, num_ids, num_threads);
  const CopyPiece* pieces = plan.pieces.data();
  const int threads = static_cast<int>(plan.first_piece.size()) - 1;
  if (threads == 1) {
    copy_pieces(pieces, pieces + plan.pieces.size(), plan.streaming);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int worker = 0; worker < threads; ++worker) {
    copy_pieces(pieces + plan.first_piece[worker], pieces + plan.first_piece[worker + 1], plan.streaming);
  }
}

}  // namespace kvcopy
