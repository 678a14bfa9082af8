"""Which cores a CPU engine's TP workers are bound to: pure planning from the cores this process may run on."""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

from bridge.errors import ConfigError

__all__ = ["allowed_cores", "cpu_thread_binding"]


def _id_list(ids: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (the form vLLM parses)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def cpu_thread_binding(tp_size: int, cores: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value giving each TP worker its own slice of ``cores``: the ids this
    process may run on (``os.sched_getaffinity``: a container's cpuset or a ``taskset`` mask), not ``0..N-1``.
    Equal slices in ascending order, the remainder left to the engine's other processes; with fewer cores
    than workers, worker ``r`` gets core ``r mod len(cores)`` (workers share cores)."""
    if tp_size < 1 or not cores:
        raise ConfigError(f"cpu_thread_binding needs tp_size >= 1 and some cores, got {tp_size}, {list(cores)}")
    ids = sorted(set(cores))
    per = max(len(ids) // tp_size, 1)
    parts = []
    for rank in range(tp_size):
        lo = (rank * per) % len(ids)
        parts.append(_id_list(ids[lo:lo + per]))
    return "|".join(parts)


def allowed_cores() -> list[int]:
    """The core ids this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def cpu_engine_env(tp_size: int, env: MutableMapping[str, str]) -> None:
    """Set in ``env`` (``os.environ`` for an engine in this process, a child's environment for a ``vllm serve``)
    what vLLM's CPU backend needs on a small box, leaving any value already there: 1 GiB of KV cache
    (``VLLM_CPU_KVCACHE_SPACE``) and, with TP > 1, a core slice per worker (``VLLM_CPU_OMP_THREADS_BIND``,
    ``cpu_thread_binding`` over ``allowed_cores``); with TP 1, vLLM's own binding."""
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp_size > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp_size, allowed_cores()))
