"""Same-host shared memory segments as plain files in /dev/shm (no resource tracker, no pickling)."""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from bridge.errors import TransportError

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
PREFIX = "wb-"
VERDICT_SUFFIX = ".ok"  # a host's verdict on a segment's bytes (bridge/host_verdicts.py), unlinked with it


# wb-<tag>-<pid namespace>-<pid>-<token>[.ok]: who made a segment, so a dead maker's segments can be swept
_OWNED_RE = re.compile(re.escape(PREFIX) + r"(?P<tag>[a-z0-9_]+)-(?P<ns>[0-9]+)-(?P<pid>[0-9]+)-[0-9a-f]{12}"
                       + f"(?:{re.escape(VERDICT_SUFFIX)})?")


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 when the kernel does not say.
    Read on every call: a child forked after ``unshare`` lives in another one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_name(tag: str) -> str:
    return f"{PREFIX}{tag}-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class SweepReport:
    removed: tuple[str, ...]
    bytes: int


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def sweep_orphans(directory: Path = SHM_DIR) -> SweepReport:
    """Unlink the segments (and their verdicts) whose maker is dead: a publisher or receiver that was
    SIGKILLed (or OOM-killed) never unlinks them, and /dev/shm is memory. Only names this code makes are
    considered, and only those made in this pid namespace by a pid that no longer exists; segments of
    live processes and of other pid namespaces (a container sharing /dev/shm) are left alone, as is every
    segment when the namespace is unknown. A dead maker's pid reused by a new process keeps its segments."""
    ns = pid_namespace()
    removed: list[str] = []
    freed = 0
    if ns == 0:
        return SweepReport((), 0)
    try:
        names = os.listdir(directory)
    except OSError:
        return SweepReport((), 0)
    for name in names:
        m = _OWNED_RE.fullmatch(name)
        if m is None or int(m["ns"]) != ns or _alive(int(m["pid"])):
            continue
        path = directory / name
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue  # gone meanwhile (another sweeper)
        removed.append(name)
        freed += size
    if removed:
        logger.warning("removed %d shared-memory segments (%.1f MB) left by dead processes: %s",
                       len(removed), freed / 1e6, ", ".join(sorted(removed)[:8]))
    return SweepReport(tuple(sorted(removed)), freed)


def _path(name: str) -> Path:
    if "/" in name or not name.startswith(PREFIX) or len(name) > 200:
        raise TransportError(f"invalid shared-memory segment name {name!r}")
    return SHM_DIR / name


def verdict_path(name: str) -> Path:
    return _path(name + VERDICT_SUFFIX)


class Segment:
    """A named, mapped shared-memory segment. The creator unlinks it; attachers only map it."""

    def __init__(self, name: str, size: int, create: bool, private: bool = False) -> None:
        self.name = name
        self.size = size
        self.owner = create
        path = _path(name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot open shared-memory segment {name}: {exc}") from exc
        try:
            if create:
                os.ftruncate(fd, max(size, 1))
            else:
                actual = os.fstat(fd).st_size
                if actual < size:
                    raise TransportError(f"shared-memory segment {name} holds {actual} bytes, expected {size}")
            flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
            self.mm = mmap.mmap(fd, max(size, 1), flags=flags)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, tag: str, size: int) -> Segment:
        return cls(new_name(tag), size, create=True)

    @classmethod
    def attach(cls, name: str, size: int, private: bool = False) -> Segment:
        """Map an existing segment; ``private`` maps it copy-on-write (writes stay in this process)."""
        return cls(name, size, create=False, private=private)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.mm)[: self.size]

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            logger.debug("segment %s still has views; leaving it mapped until they are freed", self.name)
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        for path in (_path(self.name), verdict_path(self.name)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


class KeptSegment(Segment):
    """A publisher's segment mapped by an ``AttachCache``: the sessions that use it let go with ``close``,
    which keeps the mapping; only the cache unmaps it."""

    def __init__(self, name: str, size: int, private: bool = False) -> None:
        super().__init__(name, size, create=False, private=private)

    def close(self) -> None:
        return None

    def unmap(self) -> bool:
        """Unmap now; False while views of it are still alive (try again later)."""
        try:
            self.mm.close()
        except BufferError:
            return False
        return True


class AttachCache:
    """Publishers' shared-memory segments, mapped once and kept from one update to the next.

    A publisher reuses one segment per bucket index, so the next update arrives in pages this process
    has already mapped, without the page-table set-up a fresh mapping pays on first touch. Mappings pin a
    segment's memory after the publisher unlinks it,
    so ``prune`` unmaps every segment whose file is gone (the receiver calls it about once a second).

    ``private`` keeps copy-on-write mappings (what a TP worker hands to model code, so a loader that
    writes into its input never changes the bytes other ranks read). A private page this process wrote
    no longer follows the file, so a mapping is reused only while ``copied_pages`` finds none; where the
    kernel does not say (no readable /proc/self/pagemap), every attach maps afresh."""

    def __init__(self, private: bool = False) -> None:
        self.private = private
        self._keep = not private or pagemap_readable()
        self._kept: dict[str, KeptSegment] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def attach(self, name: str, size: int) -> Segment:
        """The kept mapping of ``name`` when it has at least ``size`` bytes (a publisher may put a smaller
        bucket into a segment it made for a larger one) and, if private, no page copied on write;
        otherwise a new one (TransportError when the segment cannot be mapped)."""
        if not self._keep:
            return Segment.attach(name, size, private=True)
        kept = self._kept.get(name)
        if kept is not None and kept.size >= size and not (self.private and copied_pages(kept.mm) != 0):
            return kept
        if kept is not None:
            self._drop(name)
            if name in self._kept:  # the old mapping still has views: this use maps its own, unmapped on close
                return Segment.attach(name, size, private=self.private)
        seg = self._kept[name] = KeptSegment(name, size, private=self.private)
        return seg

    def prune(self) -> None:
        """Unmap the segments whose publisher has unlinked them."""
        for name in [n for n in self._kept if not _path(n).exists()]:
            self._drop(name)

    def _drop(self, name: str) -> None:
        if self._kept[name].unmap():
            del self._kept[name]
        else:  # a view is still alive; it stays listed and the next prune tries again
            logger.debug("segment %s still has views; unmapping it later", name)

    def close(self) -> None:
        for name in list(self._kept):
            self._drop(name)


_PAGEMAP = Path("/proc/self/pagemap")
_PRESENT, _SWAPPED, _FILE_OR_SHARED = 1 << 63, 1 << 62, 1 << 61


def pagemap_readable() -> bool:
    try:
        with _PAGEMAP.open("rb") as f:
            f.read(8)
    except OSError:
        return False
    return True


def copied_pages(mm: mmap.mmap) -> int | None:
    """How many pages of the private file mapping ``mm`` this process has written (each one copied on
    write, so it no longer shows the file's later contents), read from /proc/self/pagemap. None when the
    kernel does not say."""
    import ctypes

    import numpy as np

    anchor = ctypes.c_char.from_buffer(mm)  # pins mm only while the address is read
    address = ctypes.addressof(anchor)
    del anchor
    pages = (len(mm) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    try:
        fd = os.open(_PAGEMAP, os.O_RDONLY)
        try:
            raw = os.pread(fd, pages * 8, address // mmap.PAGESIZE * 8)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(raw) != pages * 8:
        return None
    entries = np.frombuffer(raw, dtype=np.uint64)
    present_private = (entries & np.uint64(_PRESENT | _FILE_OR_SHARED)) == np.uint64(_PRESENT)
    swapped = (entries & np.uint64(_SWAPPED)) != 0  # a private page out in swap is a copy too
    return int(np.count_nonzero(present_private | swapped))


class SegmentPool:
    """Receive segments kept from one update to the next, so an update writes into pages that are already
    faulted in rather than fresh ones. Holds at most ``limit`` bytes of free segments
    (the receiver sets it to the latest update's size); the rest are closed."""

    def __init__(self, tag: str = "recv") -> None:
        self.tag = tag
        self.limit = 0
        self._free: list[Segment] = []

    @property
    def held(self) -> int:
        return sum(s.size for s in self._free)

    def take(self, size: int) -> Segment:
        """The smallest free segment of at least ``size`` bytes, or a new one of exactly ``size``."""
        fits = [s for s in self._free if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self._free.remove(seg)
            return seg
        return Segment.create(self.tag, size)

    def give(self, seg: Segment) -> None:
        """Keep ``seg`` for a later update (its previous contents are irrelevant), or close it."""
        if seg.owner and self.held + seg.size <= self.limit:
            self._free.append(seg)
        else:
            seg.close()

    def trim(self, limit: int) -> None:
        self.limit = limit
        self._free.sort(key=lambda s: s.size)
        while self._free and self.held > limit:
            self._free.pop().close()

    def close(self) -> None:
        self.trim(0)
