"""Keep the bridge's own work off the cores vLLM's CPU backend binds its TP workers to.

On CPU, vLLM pins each TP worker to a slice of cores (``VLLM_CPU_OMP_THREADS_BIND``; with ``auto`` it leaves
some cores to the rest) and leaves every other process of the engine unpinned. The receiver's verify pass,
the engine core's scheduler loop and the actor's threads then land on a worker's core as often as not, and
slow the worker: the weight load in the middle of an update, or token generation while an update is staged.
``pin_off_workers`` moves this process's threads and the engine's non-worker processes onto the cores no
worker is bound to, when there are such cores (``serve.pin_off_workers``, off by default).

The receiver of vLLM's weight-transfer backend lives inside a TP worker's process; ``receiver_cores`` and
``threads_started_on`` start it on the engine's other cores instead of the worker's binding (figures:
docs/benchmarks.md).

The trade-off of pinning (figures: docs/benchmarks.md): pinned, the worker's core is its own, but a staged update's
verify pass can no longer borrow the worker's core while it sits idle.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def spare_cores(available: set[int], workers: list[set[int]]) -> set[int]:
    """The cores of ``available`` that no worker is bound to; empty when a worker is unbound (it may run
    anywhere) or the workers hold every core."""
    if not workers or any(not w or w >= available for w in workers):
        return set()
    return available - set().union(*workers)


AUTO_LAYER_THREADS_MAX = 8  # "auto" never starts more layer threads than this


def layer_threads(setting: int | str, own: set[int] | frozenset[int], spare: set[int] | frozenset[int],
                  torch_threads: int, on_cpu: bool) -> tuple[int, frozenset[int]]:
    """How many threads process a worker's reloaded layers (``serve.reload_threads``,
    ``reload_hooks.LayerThreads``) and the cores they may run on: the worker's own binding ``own`` and the
    ``spare`` cores no TP worker is bound to (vLLM leaves them to its front end and engine core, which wait
    while an update runs). ``"auto"``: one thread per such core, at most ``AUTO_LAYER_THREADS_MAX``, when the
    worker runs on CPU with one torch thread (its ops then use one core; with more, each op already spans them),
    else 1. An integer: that many, but never more than the cores. 1 (or no core to add): inline, as vLLM
    processes layers (cores empty). Pure."""
    cores = frozenset(own) | frozenset(spare)
    if setting == "auto":
        wanted = min(len(cores), AUTO_LAYER_THREADS_MAX) if on_cpu and torch_threads == 1 else 1
    else:
        wanted = min(int(setting), len(cores))
    return (wanted, cores) if wanted > 1 else (1, frozenset())


def receiver_cores(allowed: set[int], worker: set[int], off_workers: bool) -> set[int]:
    """The cores for a receiver that lives inside a TP worker's process (vLLM's weight-transfer backend).

    vLLM binds the worker's threads to ``worker``; threads a bound thread starts inherit its binding, so a
    receiver started from the worker's RPC thread would land, verify and take ZMQ's socket I/O on the very
    core that loads the weights. It gets ``allowed`` (the cores the engine's other processes may use, the
    worker's own included) instead, as the InferenceActor's receiver in a process of its own does; with
    ``off_workers`` (``serve.pin_off_workers``) only the cores of ``allowed`` that are not the worker's, when
    there are such cores."""
    everywhere = allowed | worker
    if off_workers and everywhere - worker:
        return everywhere - worker
    return everywhere


@contextmanager
def threads_started_on(cores: set[int]) -> Iterator[None]:
    """Threads this thread starts inside the block run on ``cores`` (Linux: a new thread inherits its
    creator's binding); this thread's own binding is restored afterwards. ``cores`` empty: no change."""
    own = os.sched_getaffinity(0)
    if not cores or cores == own:
        yield
        return
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _pin(pid: int, cores: set[int]) -> int:
    """Bind every thread of process ``pid`` to ``cores``; the number of threads bound."""
    bound = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
            bound += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return bound


def pin_off_workers(worker_pids: list[int], worker_cores: list[set[int]]) -> set[int]:
    """Bind this process and every descendant that is not a TP worker to the cores the workers do not
    use. Returns those cores (empty: nothing was changed)."""
    import psutil

    spare = spare_cores(set(os.sched_getaffinity(0)), worker_cores)
    if not spare:
        return set()
    me = psutil.Process()
    others = [p.pid for p in me.children(recursive=True) if p.pid not in set(worker_pids)]
    threads = sum(_pin(pid, spare) for pid in [me.pid, *others])
    logger.info("bridge threads (%d, in %d processes) bound to cores %s, off the TP workers' %s",
                threads, 1 + len(others), sorted(spare), [sorted(w) for w in worker_cores])
    return spare
