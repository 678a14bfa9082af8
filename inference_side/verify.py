"""Verifying a staged bucket: each tensor's checksum and, under ``sync.nonfinite: reject``, finiteness."""

from __future__ import annotations

from bridge import wire
from bridge.errors import ChecksumError, NonFiniteError, WireError
from bridge.finite import all_finite


def verify_bucket(view: memoryview, specs: list[wire.TensorSpec], checksums: tuple[int, ...], nonfinite: str,
                  checksum: str = "crc32") -> None:
    """Checksums (algorithm ``checksum``; ``none``: not checked) of every tensor in a bucket and, under the
    reject policy, finiteness of floats. Both read a float tensor in one pass, chunk by chunk; a checksum
    mismatch is reported before a non-finite value (corruption on the way explains both)."""
    from bridge.checksums import function, running

    crc, fresh = (None, None) if checksum == "none" else (function(checksum), running(checksum))
    if len(checksums) != len(specs):
        raise WireError(f"bucket {specs[0].bucket if specs else '?'}: {len(checksums)} checksums for {len(specs)} tensors")
    for spec, expected in zip(sorted(specs, key=lambda s: s.offset), _by_offset(specs, checksums), strict=True):
        floats = nonfinite == "reject" and spec.dtype in wire.FLOAT_DTYPES and spec.nbytes > 0
        finite = True
        if crc is None or fresh is None:
            got = expected
            finite = not floats or all_finite(view, spec.dtype, spec.offset, spec.nbytes)
        elif floats and spec.offset + spec.nbytes <= view.nbytes:  # (a truncated one fails its checksum below)
            hasher = fresh()
            finite = all_finite(view, spec.dtype, spec.offset, spec.nbytes, visit=hasher.update)
            got = hasher.intdigest()
        else:
            got = crc(view[spec.offset : spec.offset + spec.nbytes])
        if got != expected:
            raise ChecksumError(f"tensor {spec.name}: checksum mismatch (got {got:#010x}, manifest says {expected:#010x})")
        if not finite:
            raise NonFiniteError(f"tensor {spec.name}: holds NaN or Inf (policy sync.nonfinite=reject)")


def _by_offset(specs: list[wire.TensorSpec], checksums: tuple[int, ...]) -> list[int]:
    order = sorted(range(len(specs)), key=lambda i: specs[i].offset)
    return [checksums[i] for i in order]
