"""Verifying a bucket that many trainer ranks wrote (a manifest with ``shards``, bridge/shards.py): one
checksum per byte range, each range checked where it lies in the bucket, then finiteness per tensor.

The cover (every byte of every tensor sent by exactly one known rank) was checked when the manifest arrived
(``ShardManifest.from_wire``); here each range's bytes are checked against the checksum its rank reported,
so a rank whose bytes are wrong (or that wrote over another rank's) is named by the range that fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from bridge import wire
from bridge.errors import ChecksumError, NonFiniteError, WireError
from bridge.finite import all_finite
from bridge.shards import RangeSpec, range_checksum


def verify_ranges(view: memoryview, index: int, specs: Sequence[wire.TensorSpec], ranges: Sequence[RangeSpec],
                  checksums: Sequence[int], nonfinite: str, algorithm: str) -> None:
    """Bucket ``index`` (``view``) holds tensors ``specs`` written by ranks as ``ranges`` say: each range's
    checksum must equal its entry in ``checksums`` (same order; ChecksumError naming tensor, bytes and
    rank) and, under ``nonfinite: reject``, each float tensor must be finite (NonFiniteError)."""
    if len(checksums) != len(ranges):
        raise WireError(f"bucket {index}: {len(checksums)} checksums for {len(ranges)} ranges of the shard manifest")
    offset = {s.name: s.offset for s in specs}
    if algorithm != "none":
        for r, expected in zip(ranges, checksums, strict=True):
            got = range_checksum(view, offset[r.name], r, algorithm)
            if got != expected:
                raise ChecksumError(f"tensor {r.name}: {r.describe()} from rank {r.rank}: checksum mismatch "
                                    f"(got {got:#010x}, rank {r.rank} reported {expected:#010x})")
    if nonfinite == "reject":
        for spec in specs:
            if spec.dtype in wire.FLOAT_DTYPES and spec.nbytes and not all_finite(view, spec.dtype, spec.offset, spec.nbytes):
                raise NonFiniteError(f"tensor {spec.name}: holds NaN or Inf (policy sync.nonfinite=reject)")
