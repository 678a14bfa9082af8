"""Peak resident memory of a set of processes (Linux): reset the high-water marks, read them back."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peaks(pids: list[int]) -> dict[int, int]:
    """Reset each process's VmHWM to its current RSS; return the current RSS per pid."""
    now = {}
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError as exc:
            logger.debug("cannot reset peak RSS of %s: %s", pid, exc)
        now[pid] = _status(pid).get("VmRSS", 0)
    return now


def peak_growth(before: dict[int, int]) -> int:
    """Sum over processes of (peak RSS since the reset - RSS at the reset). Shared pages count once per
    process that touched them, so this is an upper bound of what the update added."""
    total = 0
    for pid, rss in before.items():
        total += max(_status(pid).get("VmHWM", rss) - rss, 0)
    return total
