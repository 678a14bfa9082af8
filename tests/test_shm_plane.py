"""The shared-memory send plane's memory bound: it rewrites a bucket's segment only once every
receiver released that bucket (or the update was answered). Real segments in /dev/shm; the publisher's
credits are played by the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.transports.shm_plane import ShmSendPlane

KB = 1024


def _update(plane: ShmSendPlane, sizes: list[int], released_before: dict[int, set[int]]) -> list[str]:
    """One update: before allocating bucket i the receivers have released ``released_before[i]``
    (cumulative, as the publisher computes it); returns each bucket's segment name."""
    plane.configure(2)
    names = []
    for index, size in enumerate(sizes):
        plane.reusable(released_before.get(index, set()))
        buf = plane.allocate(index, size)
        buf.fill_(index)
        names.append(plane.seal(index, buf).segment)
    plane.release()
    return names


def _streaming(count: int, lag: int) -> dict[int, set[int]]:
    """Bucket i is released once bucket i + lag was loaded: before allocating bucket j, buckets < j - lag."""
    return {j: set(range(max(j - lag, 0))) for j in range(count)}


@pytest.mark.parametrize("lag", [1, 3, 5])
def test_streaming_receivers_get_a_ring_that_never_rewrites_an_unreleased_bucket(lag: int) -> None:
    plane = ShmSendPlane()
    try:
        released = _streaming(12, lag)
        names = _update(plane, [64 * KB] * 12, released)
        for j, name in enumerate(names):
            # the segment bucket j went into held no bucket the receivers had not released at that time
            earlier = [i for i in range(j) if names[i] == name]
            assert all(i in released[j] for i in earlier), (j, earlier, released[j])
        assert len(set(names)) == lag + 1  # a ring as deep as the release lag, not one segment per bucket
        assert plane.held_bytes == (lag + 1) * 64 * KB
    finally:
        plane.close()


def test_staged_receivers_release_nothing_and_get_one_segment_per_bucket_reused_next_update() -> None:
    plane = ShmSendPlane()
    try:
        first = _update(plane, [64 * KB, 64 * KB, 32 * KB], {})
        assert len(set(first)) == 3
        assert sorted(_update(plane, [64 * KB, 64 * KB, 32 * KB], {})) == sorted(first)  # the same three again
        assert plane.held_bytes == 160 * KB
    finally:
        plane.close()


def test_a_smaller_bucket_may_take_a_larger_free_segment_but_not_the_reverse() -> None:
    plane = ShmSendPlane()
    try:
        names = _update(plane, [64 * KB, 16 * KB, 128 * KB], {1: {0}, 2: {0, 1}})
        assert names[1] == names[0]  # 16 KiB fit into bucket 0's released 64 KiB segment
        assert names[2] not in names[:2]  # 128 KiB did not: a new segment
    finally:
        plane.close()


def test_segments_the_last_update_did_not_need_are_unlinked_and_a_failed_update_drops_all() -> None:
    plane = ShmSendPlane()
    try:
        staged = _update(plane, [64 * KB] * 6, {})
        streaming = _update(plane, [64 * KB] * 6, _streaming(6, 1))
        assert len(set(streaming)) == 2
        assert plane.held_bytes == 2 * 64 * KB
        assert sorted(n for n in staged if Path("/dev/shm", n).exists()) == sorted(set(streaming))
        plane.configure(2)
        plane.allocate(0, 64 * KB)
        plane.release(failed=True)  # an engine may still read them: never rewritten, unlinked now
        assert plane.held_bytes == 0 and not any(Path("/dev/shm", n).exists() for n in streaming)
    finally:
        plane.close()
