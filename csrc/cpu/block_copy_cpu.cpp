#include "block_copy_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvcopy/id_runs.h"

namespace kvcopy {
namespace {

// Below this many bytes in one call, waking a thread team costs more than it
// saves (a team start is a few microseconds; one core copies ~10 GB/s).
constexpr int64_t kParallelMinBytes = 256 * 1024;

// A coalesced run is cut into pieces of at most this size so that threads get
// balanced shares even when one run dominates the call.
constexpr int64_t kMaxPieceBytes = 1 << 20;

struct CopyPiece {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
};

void add_range(std::vector<CopyPiece>& pieces, const uint8_t* src, uint8_t* dst, int64_t nbytes) {
  for (int64_t off = 0; off < nbytes; off += kMaxPieceBytes) {
    pieces.push_back({src + off, dst + off, std::min(kMaxPieceBytes, nbytes - off)});
  }
}

// One memcpy per run of a dense plane, one per block of a strided plane.
std::vector<CopyPiece> plan_pieces(const PlaneCopy* planes, int64_t num_planes,
                                   const std::vector<IdRun>& runs) {
  std::vector<CopyPiece> pieces;
  for (const IdRun& run : runs) {
    for (int64_t p = 0; p < num_planes; ++p) {
      const PlaneCopy& plane = planes[p];
      if (plane_is_dense(plane)) {
        add_range(pieces, plane.src + run.src_id * plane.src_stride,
                  plane.dst + run.dst_id * plane.dst_stride, run.length * plane.nbytes);
        continue;
      }
      for (int64_t k = 0; k < run.length; ++k) {
        add_range(pieces, plane.src + (run.src_id + k) * plane.src_stride,
                  plane.dst + (run.dst_id + k) * plane.dst_stride, plane.nbytes);
      }
    }
  }
  return pieces;
}

}  // namespace

IdProblem check_ids(const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids,
                    int64_t src_num_blocks, int64_t dst_num_blocks) {
  for (int64_t i = 0; i < num_ids; ++i) {
    if (src_ids[i] < 0 || src_ids[i] >= src_num_blocks) return {IdProblem::kSrcOutOfRange, src_ids[i]};
    if (dst_ids[i] < 0 || dst_ids[i] >= dst_num_blocks) return {IdProblem::kDstOutOfRange, dst_ids[i]};
  }
  std::vector<bool> written(static_cast<size_t>(num_ids > 1 ? dst_num_blocks : 0));
  for (int64_t i = 0; num_ids > 1 && i < num_ids; ++i) {
    if (written[dst_ids[i]]) return {IdProblem::kDstRepeated, dst_ids[i]};
    written[dst_ids[i]] = true;
  }
  return {};
}

void copy_blocks_cpu(const PlaneCopy* planes, int64_t num_planes, const int64_t* src_ids,
                     const int64_t* dst_ids, int64_t num_ids, int num_threads) {
  if (num_ids <= 0 || num_planes <= 0) return;
  const std::vector<CopyPiece> pieces =
      plan_pieces(planes, num_planes, find_id_runs(src_ids, dst_ids, num_ids));

  int64_t total_bytes = 0;
  for (const CopyPiece& piece : pieces) total_bytes += piece.nbytes;
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  const int threads = total_bytes < kParallelMinBytes ? 1 : std::max(1, num_threads);
  if (threads == 1) {
    for (const CopyPiece& piece : pieces) std::memmove(piece.dst, piece.src, piece.nbytes);
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
    for (int64_t i = first_piece[worker]; i < first_piece[worker + 1]; ++i) {
      std::memmove(pieces[i].dst, pieces[i].src, pieces[i].nbytes);
    }
  }
}

}  // namespace kvcopy
