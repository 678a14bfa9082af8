"""Per-tensor integrity checksums, named in the manifest (``Manifest.checksum``).

``crc32`` (zlib, about 2.5 GB/s here) is what a manifest means when it names none; ``crc32c``
(Castagnoli, hardware-accelerated by the ``crc32c`` package, about 12 GB/s here) and ``xxh3`` (64-bit
XXH3 from the ``xxhash`` package, about 23 GB/s here, the fastest: it is what ``auto`` picks) are what a
publisher sends when their package is installed. The wire's ``checksums`` are unsigned ints of up to 64 bits.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from typing import Any

from bridge.errors import WireError

DEFAULT = "crc32"
NONE = "none"  # the publisher sends no checksums (sync.checksum: none); receivers that verify refuse it
# algorithms that need a package: name -> (module, function), fastest first (``auto`` takes the first installed)
OPTIONAL = {"xxh3": ("xxhash", "xxh3_64_intdigest"), "crc32c": ("crc32c", "crc32c")}
KNOWN = (DEFAULT, *OPTIONAL)


def _optional(name: str) -> Callable[[Any], int] | None:
    module, attr = OPTIONAL[name]
    try:
        fn: Callable[[Any], int] = getattr(importlib.import_module(module), attr)
    except ImportError:
        return None
    return fn


def function(name: str) -> Callable[[Any], int]:
    """The checksum function called ``name``; WireError if this side cannot compute it."""
    if name == "crc32":
        return zlib.crc32
    if name in OPTIONAL:
        fn = _optional(name)
        if fn is None:
            raise WireError(f"the manifest's checksum is {name} but the {OPTIONAL[name][0]} package is not installed here")
        return fn
    raise WireError(f"unknown checksum algorithm {name!r} (known: {', '.join(KNOWN)})")


def preferred() -> str:
    """The fastest algorithm available on this side."""
    return next((name for name in OPTIONAL if _optional(name) is not None), DEFAULT)
