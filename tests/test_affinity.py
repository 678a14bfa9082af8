"""Which cores the bridge's own threads may use, beside vLLM's CPU TP workers (inference_side/affinity.py).
The engine-side behaviour is tested on a real engine in tests/test_transports.py."""

from __future__ import annotations

import os
import threading

import pytest

from inference_side.affinity import receiver_cores, spare_cores, threads_started_on


@pytest.mark.parametrize(("available", "workers", "spare"), [
    ({0, 1}, [{0}], {1}),                          # vLLM auto on 2 cores: one for the worker
    ({0, 1, 2, 3}, [{0}, {1}], {2, 3}),            # two TP workers
    ({0, 1, 2, 3}, [{0, 1}, {2, 3}], set()),       # the workers hold every core
    ({0, 1}, [{0, 1}], set()),                     # one unbound worker
    ({0, 1, 2, 3}, [{1}, {0, 1, 2, 3}], set()),    # one worker may run anywhere: no core is safe
    ({0, 1}, [], set()),                           # no worker reported
    ({0, 1, 2}, [set()], set()),                   # a worker reported no cores
    ({2, 3}, [{0}], {2, 3}),                       # this process is already bound elsewhere
])
def test_spare_cores(available: set[int], workers: list[set[int]], spare: set[int]) -> None:
    assert spare_cores(available, workers) == spare


@pytest.mark.parametrize(("allowed", "worker", "off_workers", "cores"), [
    ({0, 1}, {0}, False, {0, 1}),            # vLLM auto on 2 cores binds the worker to 0: the receiver may use both
    ({0, 1}, {0}, True, {1}),                # serve.pin_off_workers: off the worker's core
    ({0, 1}, {0, 1}, True, {0, 1}),          # the worker holds every core: nothing to move off to
    ({0, 1, 2, 3}, {2, 3}, True, {0, 1}),
    ({1}, {0}, False, {0, 1}),               # the engine's other processes were pinned off the worker
    ({1}, {0}, True, {1}),
])
def test_receiver_cores(allowed: set[int], worker: set[int], off_workers: bool, cores: set[int]) -> None:
    assert receiver_cores(allowed, worker, off_workers) == cores


def test_threads_started_on_binds_new_threads_and_restores_this_one() -> None:
    """A thread started inside the block inherits ``cores``; the starting thread gets its binding back."""
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.skip("needs two cores to bind a thread to one of them")
    one = {min(own)}
    seen: list[set[int]] = []
    with threads_started_on(one):
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
    assert seen == [one]
    assert os.sched_getaffinity(0) == own
