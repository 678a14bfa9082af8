"""Per-tensor integrity checksums, named in the manifest (``Manifest.checksum``).

``crc32`` (zlib, about 2.5 GB/s here) is what a manifest means when it names none; ``crc32c``
(Castagnoli, hardware-accelerated by the ``crc32c`` package, about 11 GB/s here) is what the
publisher picks when that package is installed. Both are 32-bit, so the wire's ``checksums`` stay ints.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from bridge.errors import WireError

DEFAULT = "crc32"
KNOWN = ("crc32", "crc32c")
NONE = "none"  # the publisher sends no checksums (sync.checksum: none); receivers that verify refuse it


def _crc32c() -> Callable[[Any], int] | None:
    try:
        import crc32c
    except ImportError:
        return None
    fn: Callable[[Any], int] = crc32c.crc32c
    return fn


def function(name: str) -> Callable[[Any], int]:
    """The checksum function called ``name``; WireError if this side cannot compute it."""
    if name == "crc32":
        return zlib.crc32
    if name == "crc32c":
        fn = _crc32c()
        if fn is None:
            raise WireError("the manifest's checksum is crc32c but the crc32c package is not installed here")
        return fn
    raise WireError(f"unknown checksum algorithm {name!r} (known: {', '.join(KNOWN)})")


def preferred() -> str:
    """The fastest algorithm available on this side."""
    return "crc32c" if _crc32c() is not None else "crc32"
