"""Which cores the bridge's own threads may use, beside vLLM's CPU TP workers (inference_side/affinity.py).
The engine-side behaviour is tested on a real engine in tests/test_transports.py."""

from __future__ import annotations

import os
import threading

import pytest

from inference_side.affinity import (
    AUTO_LAYER_THREADS_MAX,
    layer_threads,
    receiver_cores,
    spare_cores,
    threads_started_on,
)


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


@pytest.mark.parametrize(("setting", "own", "spare", "torch_threads", "on_cpu", "threads", "cores"), [
    ("auto", {0}, {1}, 1, True, 2, {0, 1}),            # this machine at TP 1: the worker's core and the spare one
    ("auto", {0}, set(), 1, True, 1, set()),           # TP 2 on 2 cores: nothing to add, inline
    ("auto", {0}, {1}, 1, False, 1, set()),            # on a GPU: inline, as vLLM does
    ("auto", {0, 1, 2, 3}, {4}, 4, True, 1, set()),    # the worker's ops already span its cores
    ("auto", {0}, {2, 3}, 1, True, 3, {0, 2, 3}),      # TP 2 on 4 cores: both workers share the spare cores
    ("auto", {0}, set(range(1, 16)), 1, True, AUTO_LAYER_THREADS_MAX, set(range(16))),
    (1, {0}, {1}, 1, True, 1, set()),                  # told inline
    (2, {0}, set(), 1, True, 1, set()),                # never more threads than cores
    (3, {0, 1, 2, 3}, set(), 4, True, 3, {0, 1, 2, 3}),  # told: as many as asked, on the worker's cores
    (4, {0}, {1}, 1, False, 2, {0, 1}),                # told, on a GPU too
])
def test_layer_threads(setting: int | str, own: set[int], spare: set[int], torch_threads: int, on_cpu: bool,
                       threads: int, cores: set[int]) -> None:
    assert layer_threads(setting, own, spare, torch_threads, on_cpu) == (threads, frozenset(cores))


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


@pytest.mark.parametrize(("tp", "cores", "binding"), [
    (2, [0, 1], "0|1"),                                  # this machine
    (2, range(8), "0-3|4-7"),
    (3, range(8), "0-1|2-3|4-5"),                        # the remainder (6, 7) left to the engine's other processes
    (2, [4, 5, 6, 7], "4-5|6-7"),                        # a cpuset or taskset mask that leaves out 0-3
    (2, [1, 3, 5, 7, 9, 11], "1,3,5|7,9,11"),            # every other core
    (2, [2, 3, 4, 8, 9, 10], "2-4|8-10"),
    (4, [6, 7], "6|7|6|7"),                              # fewer cores than workers: they share, in turn
    (2, [5], "5|5"),
    (1, [3, 1, 2], "1-3"),
])
def test_cpu_thread_binding_slices_the_allowed_cores(tp: int, cores: list[int], binding: str) -> None:
    from bridge.cores import cpu_thread_binding

    assert cpu_thread_binding(tp, cores) == binding


@pytest.mark.parametrize(("tp", "cores"), [(0, [0, 1]), (2, [])])
def test_cpu_thread_binding_refuses_nothing_to_bind(tp: int, cores: list[int]) -> None:
    from bridge.cores import cpu_thread_binding
    from bridge.errors import ConfigError

    with pytest.raises(ConfigError, match="cpu_thread_binding needs"):
        cpu_thread_binding(tp, cores)


def test_the_tp2_binding_of_a_process_confined_to_one_core_names_that_core_only() -> None:
    """A real process confined to one core (as by a container's cpuset or ``taskset``), the last one of this
    machine's: the binding it gives vLLM's TP workers names that core alone, never core 0."""
    import json
    import subprocess
    import sys

    from tests.helpers import child_env

    last = max(os.sched_getaffinity(0))
    if last == 0:
        pytest.skip("needs a second core")
    code = ("import json, os; from inference_side.engine import apply_cpu_defaults; apply_cpu_defaults(2); "
            "print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ['VLLM_CPU_OMP_THREADS_BIND']]))")
    env = child_env()
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.sched_setaffinity(0, {last}), check=True).stdout
    allowed, binding = json.loads(out)
    assert allowed == [last] and binding == f"{last}|{last}", (allowed, binding)


@pytest.mark.parametrize(("tp", "given", "expected"), [
    (1, {}, {"VLLM_CPU_KVCACHE_SPACE": "1"}),                                  # TP 1: vLLM's own binding
    (2, {}, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "BINDING"}),
    (2, {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0|0"},   # what the caller set stays
     {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0|0"}),
])
def test_cpu_engine_env_sets_only_what_is_unset(tp: int, given: dict[str, str], expected: dict[str, str]) -> None:
    """The CPU defaults every engine start of the project uses (an engine in this process, ``vllm serve``, the
    cold-load oracle): in the environment handed in, never over a value already there; the binding slices this
    process's allowed cores."""
    from bridge.cores import allowed_cores, cpu_engine_env, cpu_thread_binding

    env = dict(given)
    cpu_engine_env(tp, env)
    binding = cpu_thread_binding(tp, allowed_cores())
    assert env == {k: (binding if v == "BINDING" else v) for k, v in expected.items()}
