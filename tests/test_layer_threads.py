"""The reload's layers processed on a pool of threads (``reload_hooks.LayerThreads``), on real threads: where each
layer runs, what waits for what, how failures come back. The engine-level behaviour (a real vLLM engine whose
layers were processed on threads equals a cold-loaded one) is tested in tests/test_delta_sync.py."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from inference_side.reload_hooks import LayerThreads


def _recorder() -> tuple[list[tuple[Any, Any, str, set[int]]], Any]:
    seen: list[tuple[Any, Any, str, set[int]]] = []

    def original(layer: Any, info: Any) -> None:
        seen.append((layer, info, threading.current_thread().name, os.sched_getaffinity(0)))

    return seen, original


@pytest.mark.parametrize("threads", [1, 0])
def test_one_thread_processes_inline(threads: int) -> None:
    pool = LayerThreads()
    pool.start(threads, {0, 1})
    seen, original = _recorder()
    pool.process(original, "layer", "info")
    assert not pool.active and pool.handed == 0
    assert seen == [("layer", "info", threading.current_thread().name, os.sched_getaffinity(0))]


def test_layers_run_on_pool_threads_bound_to_the_cores_and_wait_returns_when_all_are_done() -> None:
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.skip("needs two cores to bind the pool to one of them")
    cores = {max(own)}  # not this thread's binding: the pool's threads are bound, not born with it
    pool = LayerThreads()
    pool.start(2, cores)
    seen, original = _recorder()
    for i in range(5):
        pool.process(original, f"layer{i}", i)
    pool.wait()
    assert pool.active and pool.handed == 5
    assert sorted(s[1] for s in seen) == list(range(5))
    assert all(name.startswith("wb-layer") and affinity == cores for _, _, name, affinity in seen), seen


def test_check_raises_a_processed_layers_failure_without_waiting_for_the_others() -> None:
    pool = LayerThreads()
    pool.start(2, os.sched_getaffinity(0))
    release = threading.Event()

    def slow(layer: Any, info: Any) -> None:
        assert release.wait(30)

    def broken(layer: Any, info: Any) -> None:
        raise RuntimeError(f"{layer}: the loader failed")

    pool.process(slow, "a", None)
    pool.process(broken, "b", None)
    for _ in range(300):  # the failing layer ends while the slow one still runs
        if all(f.done() for f in pool._pending[1:]):
            break
        threading.Event().wait(0.01)
    timer = threading.Timer(0.3, release.set)  # check() stops the pool: it waits for the slow layer
    timer.start()
    with pytest.raises(RuntimeError, match="b: the loader failed"):
        pool.check()
    timer.join()
    assert not pool.active


def test_wait_raises_the_first_failure_once_every_layer_ended() -> None:
    pool = LayerThreads()
    pool.start(2, os.sched_getaffinity(0))
    ended: list[str] = []

    def fails(layer: Any, info: Any) -> None:
        ended.append(layer)
        raise ValueError(f"{layer} failed")

    def ok(layer: Any, info: Any) -> None:
        threading.Event().wait(0.2)
        ended.append(layer)

    pool.process(fails, "first", None)
    pool.process(ok, "second", None)
    pool.process(fails, "third", None)
    with pytest.raises(ValueError, match="first failed"):
        pool.wait()
    assert sorted(ended) == ["first", "second", "third"]
    pool.wait()  # nothing left


def test_the_workers_thread_waits_while_too_many_layers_are_pending() -> None:
    pool = LayerThreads()
    pool.start(2, os.sched_getaffinity(0))
    release = threading.Event()

    def held(layer: Any, info: Any) -> None:
        assert release.wait(30)

    limit = LayerThreads.QUEUED_PER_THREAD * 2
    for i in range(limit):
        pool.process(held, i, None)
    handed = threading.Event()
    extra = threading.Thread(target=lambda: (pool.process(held, "extra", None), handed.set()))
    extra.start()
    assert not handed.wait(0.3), "a layer beyond the limit was handed over while none was done"
    release.set()
    assert handed.wait(10)
    extra.join()
    pool.wait()
    assert pool.handed == limit + 1


def test_stop_waits_drops_failures_and_later_layers_run_inline() -> None:
    pool = LayerThreads()
    pool.start(2, os.sched_getaffinity(0))

    def broken(layer: Any, info: Any) -> None:
        raise RuntimeError("lost")

    pool.process(broken, "a", None)
    pool.stop()
    assert not pool.active
    seen, original = _recorder()
    pool.process(original, "b", None)
    assert seen[0][2] == threading.current_thread().name
