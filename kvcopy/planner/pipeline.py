"""Two transfers in a pipeline: the time of moving bytes through a first stage and then a second, in chunks.

Fetching a prefix from a peer is a network read into the host pool followed by the local reload of the
same bytes. Cut into K chunks, chunk k reloads while chunk k+1 is read: the whole takes the first chunk's
read, K-1 steps of the slower stage, and the last chunk's reload. Each chunk pays its stage's fixed cost,
so more chunks overlap more but cost more calls; the best K is searched.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MAX_PIPELINE_CHUNKS", "pipelined_seconds"]

# The most chunks a pipelined fetch is cut into: beyond a few dozen the per-call costs outweigh the overlap
# already won (the overlap's gain shrinks as 1/K), and an engine submits that many reads per request at most.
MAX_PIPELINE_CHUNKS = 64


def pipelined_seconds(
    nbytes: float, max_chunks: int, first: Callable[[float], float], second: Callable[[float], float]
) -> tuple[float, int]:
    """(seconds, chunks) of moving ``nbytes`` through ``first`` then ``second`` (each: seconds for a chunk of
    that many bytes) at the best chunk count: a power of two up to ``min(max_chunks, MAX_PIPELINE_CHUNKS)``;
    one chunk is the two one after the other."""
    best = (first(nbytes) + second(nbytes), 1)
    chunks = 2
    while chunks <= min(max_chunks, MAX_PIPELINE_CHUNKS):
        a, b = first(nbytes / chunks), second(nbytes / chunks)
        best = min(best, (a + b + (chunks - 1) * max(a, b), chunks))
        chunks *= 2
    return best
