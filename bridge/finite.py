"""Finiteness of a float tensor read straight from its bytes, at memory speed.

In every float format on the wire the non-finite values (Inf, NaN) are the largest bit patterns of each
sign half: as a signed integer a positive one is >= the bits of +Inf, and as an unsigned integer a
negative one is >= the bits of -Inf (float8_e4m3fn has no Inf: its NaN, S.1111.111, is the top pattern).
So two integer max reductions decide it exactly, with no float arithmetic and no temporary (several times
faster than a float sum or ``isfinite(t).all()``: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# dtype -> (bytes per element, bits of +Inf (lowest positive non-finite), bits of -Inf (lowest negative one, unsigned))
LIMITS: dict[str, tuple[int, int, int]] = {
    "float64": (8, 0x7FF0000000000000, 0xFFF0000000000000),
    "float32": (4, 0x7F800000, 0xFF800000),
    "bfloat16": (2, 0x7F80, 0xFF80),
    "float16": (2, 0x7C00, 0xFC00),
    "float8_e4m3fn": (1, 0x7F, 0xFF),
    "float8_e5m2": (1, 0x7C, 0xFC),
}
CHUNK_BYTES = 2 << 20  # both reductions run over one chunk while it is in cache


def all_finite(buffer: Any, dtype: str, offset: int = 0, nbytes: int | None = None,
               visit: Callable[[memoryview], None] | None = None) -> bool:
    """True when every ``dtype`` element of ``buffer[offset:offset+nbytes]`` is finite (little-endian).

    ``visit`` is handed each chunk's bytes, in order, just before the chunk is checked, so a checksum can
    read them while they are in cache; with a visitor every chunk is read, even after a non-finite one."""
    import numpy as np

    width, pos_inf, neg_inf = LIMITS[dtype]
    total = (memoryview(buffer).nbytes - offset if nbytes is None else nbytes) // width
    signed = np.frombuffer(buffer, dtype=f"<i{width}", count=total, offset=offset)
    unsigned = signed.view(f"<u{width}")
    raw = memoryview(buffer).cast("B")[offset : offset + total * width]
    step = CHUNK_BYTES // width
    finite = True
    for start in range(0, total, step):
        if visit is not None:
            visit(raw[start * width : (start + step) * width])
        elif not finite:
            break
        if finite and (int(signed[start : start + step].max()) >= pos_inf or int(unsigned[start : start + step].max()) >= neg_inf):
            finite = False
    return finite
