"""How long a TP worker busy-waits for its next RPC: vLLM's shared-memory message queue keeps each
reader spinning (``sched_yield`` in a loop) for ``busy_loop_s`` seconds, 1 s in vLLM, after every message,
so that a burst of RPCs (generation steps) sees no wake-up latency.

On a host with few cores that second is paid by whatever runs next: a weight sync right after generation
or after the previous update, whose trainer-side packing and receiver-side verification then share the
one core the spinning worker leaves them (figures: docs/benchmarks.md). ``serve.worker_idle_spin_s``
shortens it in every TP worker; anything longer than the gap between generation steps keeps vLLM's
latency while the engine generates.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def set_reader_spin(seconds: float) -> list[float]:
    """Set ``busy_loop_s`` of every message-queue reader in this process; return their previous values
    (empty when this vLLM has no such readers)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        logger.warning("this vLLM has no shm_broadcast.SpinCondition: worker_idle_spin_s not applied")
        return []
    previous = []
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance on a dead weakref.proxy raises ReferenceError
        if issubclass(type(obj), SpinCondition) and getattr(obj, "is_reader", False):
            previous.append(float(obj.busy_loop_s))
            obj.busy_loop_s = seconds
    if previous:
        logger.info("message-queue readers now spin %.3fs after each message (were %s)", seconds, previous)
    else:
        logger.warning("no message-queue reader found in this process: worker_idle_spin_s not applied")
    return previous
