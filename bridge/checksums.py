"""Per-tensor integrity checksums, named in the manifest (``Manifest.checksum``).

``crc32`` (zlib) is what a manifest means when it names none; ``crc32c`` (Castagnoli, hardware-accelerated
by the ``crc32c`` package) and ``xxh3`` (64-bit XXH3 from the ``xxhash`` package, the fastest, so what ``auto``
picks) are what a publisher sends when their package is installed (speeds: docs/benchmarks.md). The wire's ``checksums`` are unsigned ints of up to 64 bits.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from typing import Any, Protocol

from bridge.errors import WireError

DEFAULT = "crc32"
NONE = "none"  # the publisher sends no checksums (sync.checksum: none); receivers that verify refuse it
# algorithms that need a package: name -> (module, function, running hasher class or "" when the function
# continues from a previous value), fastest first (``auto`` takes the first installed)
OPTIONAL = {"xxh3": ("xxhash", "xxh3_64_intdigest", "xxh3_64"), "crc32c": ("crc32c", "crc32c", "")}
KNOWN = (DEFAULT, *OPTIONAL)


class Running(Protocol):
    """A checksum fed piece by piece: the same value as the function over the pieces joined."""

    def update(self, data: Any) -> None: ...
    def intdigest(self) -> int: ...


class _Continued:
    """A CRC-style function that takes the previous value as its second argument, fed piece by piece."""

    def __init__(self, fn: Callable[[Any, int], int]) -> None:
        self._fn = fn
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = self._fn(data, self._value)

    def intdigest(self) -> int:
        return self._value


def running(name: str) -> Callable[[], Running]:
    """A factory of running checksums of algorithm ``name`` (WireError as for ``function``)."""
    fn = function(name)
    if name in OPTIONAL and OPTIONAL[name][2]:
        factory: Callable[[], Running] = getattr(importlib.import_module(OPTIONAL[name][0]), OPTIONAL[name][2])
        return factory
    return lambda: _Continued(fn)  # type: ignore[arg-type]


def _optional(name: str) -> Callable[[Any], int] | None:
    module, attr, _ = OPTIONAL[name]
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
