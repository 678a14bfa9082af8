"""One verification per host for the bytes of a shared-memory segment, shared by every receiver there.

Every receiver on a host reads a publisher's bucket from the same /dev/shm segment, so the bytes each
one would check are the same bytes: checking them once per host is as safe as checking them once per
receiver, where N receivers would otherwise spend N memory passes on one bucket. The verdict lives
next to the segment in ``<segment>.ok`` (unlinked with it): under an exclusive ``flock`` the first
receiver verifies and, only on success, writes the verdict's key; the others wait for the lock, find
the key and skip.

The key must name exactly the bytes that were verified and how: the publisher's random token of this
send, the segment, version, bucket, checksum algorithm and values, and the receiver's policy (a stricter
receiver never takes a laxer verdict). A publisher rewrites a segment within a send only for another
bucket (streaming's ring, once every receiver released the first) and otherwise only in another send,
under another token, so a key never outlives the bytes it was made for. A failed verification writes
nothing, so every receiver reports the failure itself.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable

from bridge.shm import SHM_DIR, verdict_path

logger = logging.getLogger(__name__)
POLL_S = 0.0005


def verdict_key(*parts: object) -> bytes:
    """A fixed-size key for a verdict over ``parts`` (token, segment, version, bucket, checksums, policy)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def verify_once(segment: str, key: bytes, verify: Callable[[], None], wait_s: float) -> bool:
    """Run ``verify`` (which raises on bad bytes) unless a process on this host already verified
    ``segment`` under ``key``; True when it ran here. A caller that cannot take the verdict's lock
    within ``wait_s`` (its holder is stuck), or cannot open the verdict file, verifies on its own."""
    path = verdict_path(segment)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        logger.debug("no verdict file for %s (%s): verifying here", segment, exc)
        verify()
        return True
    if not (SHM_DIR / segment).exists():  # its owner unlinked it (and its verdict): leave nothing behind
        path.unlink(missing_ok=True)
        os.close(fd)
        verify()
        return True
    try:
        if not _lock(fd, wait_s):
            logger.warning("verdict lock of %s held for over %.1fs: verifying here", segment, wait_s)
            verify()
            return True
        if os.pread(fd, len(key) + 1, 0) == key:
            return False
        os.ftruncate(fd, 0)  # no verdict while this one runs: a failure leaves none behind
        verify()
        os.pwrite(fd, key, 0)
        return True
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > end:
                return False
        time.sleep(POLL_S)
