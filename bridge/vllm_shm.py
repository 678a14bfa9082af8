"""vLLM's own shared-memory segments (``/dev/shm/psm_*``, and ``vllm_dist_*-cpushm_*`` on CPU at TP >= 2) left behind
by engines that were killed.

vLLM's message queues (``distributed/device_communicators/shm_broadcast.py``: the executor's RPC broadcast
queue and the workers' response queues), its object storage and tensor arena all live in Python
``multiprocessing.shared_memory.SharedMemory`` segments. Their names are random, ``psm_`` and 8 hex digits
(``shared_memory._make_filename``), and say nothing about who made them. But every one of vLLM's makers keeps
its segment mapped, and its file descriptor open, for as long as the segment lives, and unlinks it on the
way out (``ShmRingBuffer.__del__``, ``SingleWriterShmRingBuffer.close``); its readers map it too. An engine
that exits unlinks its segments; one that is killed (SIGKILL, the OOM killer) together with the resource
tracker it started leaves them in ``/dev/shm``, which is memory, up to 250 MB each.

On CPU with TP >= 2 each worker also makes one segment for the workers' shared-memory collectives (vLLM's C++
``init_shm_manager``, ``device_communicators/cpu_communicator.py``), named
``vllm_dist_<32 hex>-<group>-[<ranks>]-cpushm_<rank>``: every worker of the group maps every one of them for as long
as the engine lives (its file descriptor is closed once mapped), and the engine unlinks them on a clean exit.

So a ``psm_*`` segment that no live process maps or holds open, or a ``cpushm`` segment no live process maps, has
lost every process that used it: its engine died. The one short exception in vLLM is ``is_in_the_same_node`` (``distributed/parallel_state.py``),
whose 128-byte probe is closed by every rank, then unlinked by its maker after a barrier; so a segment is
only removed once nothing wrote to it for ``min_age_s`` as well (its modification time, which writes through a
mapping move too).

What this cannot tell, and so leaves alone (``VllmSweepReport.not_cleaned`` says which and why):

* a segment owned by a user one of whose processes this sweeper cannot inspect (``/proc/PID/fd`` not
  readable; a process whose ``/proc/PID/maps`` alone is hidden, such as a non-dumpable one, is judged by its
  open files, which a ``cpushm`` segment's users do not keep: such a process is not seen using one, and
  removing a live engine's removes only its name, which its workers open while they start). Run as another
  user than root, the sweep does not see a root process that maps a segment of this user (a ``psm_*`` file
  is 0600: only its owner and root can open it);
* a segment this user may not remove (another user's file in the sticky ``/dev/shm``, when not root);
* processes of another pid namespace are invisible here: run the sweep in the pid namespace of everything
  that shares this ``/dev/shm`` (a host, or a container or Ray node with a ``/dev/shm`` of its own).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from bridge.shm import SHM_DIR

logger = logging.getLogger(__name__)

# multiprocessing.shared_memory's names on POSIX; the CPU workers' collectives (TP >= 2)
SEGMENT_RE = re.compile(r"psm_[0-9a-f]{8}|vllm_dist_[0-9a-f]{32}-.+-cpushm_[0-9]+")
MIN_AGE_S = 60.0
PROC = Path("/proc")


@dataclass(frozen=True)
class Segment:
    """What the sweep knows of one segment file."""

    name: str
    inode: int
    uid: int
    size: int  # apparent size
    resident: int  # bytes of its pages in memory
    changed: float  # its modification time: creation, or the last write (through a mapping too)


@dataclass(frozen=True)
class Users:
    """Who uses segments in the directory, as far as ``/proc`` shows: inodes some process maps, names some
    process holds open, and the uids of processes that could not be inspected."""

    mapped: frozenset[int]
    open: frozenset[str]
    hidden_uids: frozenset[int]


@dataclass(frozen=True)
class VllmSweepReport:
    removed: tuple[str, ...]  # no live process used them: unlinked
    bytes: int  # their apparent size
    resident: int  # the memory they held
    in_use: tuple[str, ...]  # kept: mapped or held open by a live process
    young: tuple[str, ...]  # kept: unused, but written less than min_age_s ago
    not_cleaned: tuple[tuple[str, str], ...]  # (name, why) of segments left that may be a dead engine's


def verdict(segment: Segment, users: Users, now: float, min_age_s: float) -> str:
    """What the sweep does with ``segment``: ``in_use``, ``young``, ``remove``, or why it cannot tell."""
    if segment.inode in users.mapped or segment.name in users.open:
        return "in_use"
    if segment.uid in users.hidden_uids:
        return f"cannot tell: processes of uid {segment.uid} that may use it could not be inspected (run as root)"
    if now - segment.changed < min_age_s:
        return "young"
    return "remove"


def _segments(directory: Path) -> list[Segment]:
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if SEGMENT_RE.fullmatch(name) is None:
            continue
        try:
            st = os.stat(directory / name, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        found.append(Segment(name, st.st_ino, st.st_uid, st.st_size, st.st_blocks * 512, st.st_mtime))
    return found


def scan_users(directory: Path = SHM_DIR, proc: Path = PROC) -> Users:
    """Every process's mappings and open files under ``directory`` (``/proc/PID/maps`` and ``/proc/PID/fd``).
    A process whose mappings cannot be read is judged by its open files alone (a Python ``SharedMemory``,
    which makes every ``psm_*`` segment, holds its file descriptor from open to close); one whose open files
    cannot be read either counts as hidden."""
    prefix = f"{directory}/"
    mapped: set[int] = set()
    opened: set[str] = set()
    hidden: set[int] = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        base = proc / pid
        try:
            with open(base / "maps", "rb") as f:
                data = f.read()
            if prefix.encode() in data:
                for line in data.splitlines():
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(prefix.encode()):
                        mapped.add(int(fields[4]))
        except PermissionError:
            pass  # judged by its open files: a SharedMemory keeps its file descriptor for as long as it maps it
        except OSError:
            continue  # exited meanwhile
        try:
            fds = os.listdir(base / "fd")
        except PermissionError:
            try:
                hidden.add(os.stat(base).st_uid)
            except OSError:
                pass  # it exited meanwhile
            continue
        except OSError:
            continue  # exited meanwhile
        for fd in fds:
            try:
                target = os.readlink(base / "fd" / fd)
            except OSError:
                continue
            if target.startswith(prefix):
                opened.add(target[len(prefix):].removesuffix(" (deleted)"))
    return Users(frozenset(mapped), frozenset(opened), frozenset(hidden))


def sweep_vllm_segments(directory: Path = SHM_DIR, min_age_s: float = MIN_AGE_S, proc: Path = PROC) -> VllmSweepReport:
    """Unlink vLLM's segments in ``directory`` (``SEGMENT_RE``) that no live process maps or holds open and that did not
    change for ``min_age_s``: those of vLLM engines that were killed (see the module's docstring). Segments in
    use, young ones and those it cannot judge or remove are kept; the report lists each group. Reads every
    process's ``/proc/PID/maps`` only when some segment is old enough to be a candidate."""
    segments = _segments(directory)
    now = time.time()
    if not any(now - s.changed >= min_age_s for s in segments):
        return VllmSweepReport((), 0, 0, (), tuple(sorted(s.name for s in segments)), ())
    users = scan_users(directory, proc)
    removed: list[Segment] = []
    in_use: list[str] = []
    young: list[str] = []
    not_cleaned: list[tuple[str, str]] = []
    for seg in segments:
        what = verdict(seg, users, now, min_age_s)
        if what == "in_use":
            in_use.append(seg.name)
        elif what == "young":
            young.append(seg.name)
        elif what != "remove":
            not_cleaned.append((seg.name, what))
        else:
            try:
                os.unlink(directory / seg.name)
            except FileNotFoundError:
                continue  # another sweeper took it
            except OSError as exc:
                not_cleaned.append((seg.name, f"cannot remove it (owner uid {seg.uid}): {exc.strerror}"))
                continue
            removed.append(seg)
    report = VllmSweepReport(tuple(sorted(s.name for s in removed)), sum(s.size for s in removed),
                             sum(s.resident for s in removed), tuple(sorted(in_use)), tuple(sorted(young)),
                             tuple(sorted(not_cleaned)))
    if removed:
        logger.warning("removed %d vLLM shared-memory segments left by dead engines (%.1f MB resident, %.1f MB apparent): %s",
                       len(removed), report.resident / 1e6, report.bytes / 1e6, ", ".join(report.removed[:8]))
    if not_cleaned:
        logger.warning("left %d vLLM shared-memory segments the sweep cannot clean: %s", len(not_cleaned),
                       "; ".join(f"{n}: {why}" for n, why in report.not_cleaned[:4]))
    return report
