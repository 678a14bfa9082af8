"""Compiled loops for the hot paths of a delta sync, with numba (a dependency of vLLM, so installed wherever
an engine runs; ``numba`` is also in this project's dependencies): the publisher's compare of the trainer's
tensors with its base, and the receiver's decode and application of a sparse payload.

Each loop computes exactly what its numpy form in ``bridge.delta`` computes (tests/test_delta.py runs both on
the same inputs); ``bridge.delta.compiled()`` returns this module where it loads, and ``bridge.delta`` then calls these loops, the numpy form
otherwise (numba not importable, or a big-endian host, where the word lanes below would be misread). Why: on
two cores the delta sync's engine load shares the CPU and the memory bus with the publisher's compare and the
receiver's patching, and numpy needs several passes per chunk where these need one (docs/benchmarks.md,
"Compiled compare and patch").

Compiled on first use in a process and cached on disk (numba's ``cache=True``: ``__pycache__`` beside this
file, or ``NUMBA_CACHE_DIR``), so a later process loads them instead (numba's import and the load: about 0.7 s,
2.8 s when compiling; ``bridge.delta.warm_compiled`` does it ahead of the first delta). The loops release the GIL.
"""

from __future__ import annotations

import numba
import numpy as np

U64 = np.uint64


@numba.njit(nogil=True, cache=True)
def compare_words(old: np.ndarray, new: np.ndarray, lanes: int, lane_bits: int, patch: bool,
                  positions: np.ndarray, xors: np.ndarray) -> int:  # pragma: no cover - compiled
    """``old`` and ``new``: uint64 words of one size holding ``lanes`` little-endian elements of ``lane_bits``
    bits each. Writes the element index (from the first word) of every element whose bits differ into
    ``positions`` (int64) and the XOR of its two bit patterns into ``xors`` (uint64), in increasing order;
    with ``patch`` each differing word of ``old`` is overwritten with ``new``'s. Returns how many it wrote
    (both outputs hold at least ``lanes * old.size``)."""
    mask = ~U64(0) if lane_bits == 64 else (U64(1) << U64(lane_bits)) - U64(1)
    k = 0
    for i in range(old.size):
        a = old[i]
        b = new[i]
        if a != b:
            d = a ^ b
            for lane in range(lanes):
                v = (d >> U64(lane * lane_bits)) & mask
                if v != 0:
                    positions[k] = i * lanes + lane
                    xors[k] = v
                    k += 1
            if patch:
                old[i] = b
    return k


@numba.njit(nogil=True, cache=True)
def decode_sparse(raw: np.ndarray, k: int, iw: int, width: int, numel: int,
                  positions: np.ndarray, values: np.ndarray) -> int:  # pragma: no cover - compiled
    """A sparse payload's ``k`` gaps (``iw``-byte elements) and XOR values (``width``-byte), both as byte
    planes in ``raw``, into ``positions`` (int64, the gaps summed) and ``values`` (unsigned, ``width`` bytes).
    Returns 0, or 1 when a gap is not below ``numel`` or a gap after the first is 0 (positions not strictly
    increasing inside the tensor), or 2 when the last position is not below ``numel``."""
    pos = np.int64(0)
    base = iw * k  # where the value planes start
    for j in range(k):
        gap = U64(0)
        for b in range(iw):
            gap |= U64(raw[b * k + j]) << U64(8 * b)
        if gap >= U64(numel) or (j > 0 and gap == U64(0)):
            return 1
        pos += np.int64(gap)
        positions[j] = pos
        v = U64(0)
        for b in range(width):
            v |= U64(raw[base + b * k + j]) << U64(8 * b)
        values[j] = v
    if k > 0 and pos >= numel:
        return 2
    return 0


@numba.njit(nogil=True, cache=True)
def patch_sparse(bits: np.ndarray, positions: np.ndarray, values: np.ndarray, old: np.ndarray,
                 lo: int, hi: int) -> None:  # pragma: no cover - compiled
    """For ``j`` in ``[lo, hi)``: ``old[j]`` gets ``bits[positions[j]]``, which becomes itself XOR
    ``values[j]``, and ``values[j]`` gets that new value (what was written)."""
    for j in range(lo, hi):
        p = positions[j]
        o = bits[p]
        n = o ^ values[j]
        old[j] = o
        values[j] = n
        bits[p] = n
