"""Which cores the bridge's own threads may use, beside vLLM's CPU TP workers (inference_side/affinity.py).
The engine-side behaviour is tested on a real engine in tests/test_transports.py."""

from __future__ import annotations

import pytest

from inference_side.affinity import spare_cores


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
