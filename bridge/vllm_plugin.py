"""Registration of the ``weight_bridge`` backend in vLLM's weight-transfer factories.

``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls it in every process it
starts (the API server or ``LLM`` process, the engine core, each worker). The backend's classes are named by
module path and imported only when vLLM makes one. Idempotent; never raises (a plugin that raises stops vLLM).

``ENGINE_CORE_SPIN_ENV``, when set in the environment vLLM starts with, shortens how long the engine core
busy-waits for its workers' answers (``serve.engine_core_spin_s``; ``_tune_engine_core_spin``).

``ADAPTER_ROUTE`` is the ``vllm serve`` route of the ``vllm.endpoint_plugins`` entry point of the same name
(inference_side/vllm_adapters.py; vLLM loads it only when ``VLLM_PLUGINS`` names ``weight_bridge``): it makes
a LoRA adapter version the backend verified serveable under the adapter's name.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

BACKEND = "weight_bridge"
WORKER_ENGINE = ("inference_side.vllm_backend", "WeightBridgeEngine")
TRAINER_ENGINE = ("trainer_side.vllm_backend", "WeightBridgeTrainerEngine")
ADAPTER_ROUTE = "/weight_bridge/adapters"  # POST {name, version, path}: serve a verified adapter version; GET: list
ENGINE_CORE_SPIN_ENV = "WEIGHT_BRIDGE_ENGINE_CORE_SPIN_S"
# with a short spin every wait relies on the writer's notification, which vLLM can lose (it rechecks its queue
# every 5 s for that reason): waits recheck this often instead
RECHECK_MS = 1
KEEP_SPIN = "vllm"  # the variable's value that keeps vLLM's spin and only shortens the recheck


def register() -> None:
    _tune_engine_core_spin()
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # a vLLM without the weight-transfer API
        return
    try:
        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(BACKEND, *WORKER_ENGINE)
        if BACKEND not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(BACKEND, *TRAINER_ENGINE)
    except Exception as exc:  # noqa: BLE001 - never stop vLLM
        logger.warning("weight_bridge: could not register the backend: %s", exc)


def _spin_from_env() -> tuple[bool, float | None]:
    """``WEIGHT_BRIDGE_ENGINE_CORE_SPIN_S``: (readers recheck every ``RECHECK_MS``, the engine core's spin in
    seconds or None to keep vLLM's). Unset, or not ``vllm`` or seconds >= 0 (logged): (False, None)."""
    import os

    raw = os.environ.get(ENGINE_CORE_SPIN_ENV)
    if raw is None:
        return False, None
    if raw == KEEP_SPIN:
        return True, None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        logger.warning("weight_bridge: %s=%r is neither %r nor seconds >= 0: vLLM's message queue left as it is",
                       ENGINE_CORE_SPIN_ENV, raw, KEEP_SPIN)
        return False, None
    return True, seconds


def _tune_engine_core_spin() -> None:
    """While ``WEIGHT_BRIDGE_ENGINE_CORE_SPIN_S`` is set to seconds >= 0, each reader of vLLM's shared-memory
    message queue made in this process, unless it is a TP worker's (those: ``serve.worker_idle_spin_s``),
    busy-waits that long after each message instead of vLLM's 1 s; and each reader made while it is set (to
    seconds or to ``vllm``, which keeps vLLM's spin) rechecks its queue every ``RECHECK_MS`` while it sleeps
    instead of every 5 s: a reader that spins less waits on vLLM's wake-up notification more often, and
    vLLM loses some (a 0 s spin stalled 2 of 15 syncs for 5.7 s), so a TP worker with
    ``serve.worker_idle_spin_s`` needs the recheck even where the engine core keeps its spin.

    The engine core waits for its workers' answers in such a reader: with vLLM's 1 s it spins a core through
    every RPC of an update (0.3-0.5 CPU-seconds per 350m delta sync on 2 cores, beside the worker's load and
    the receiver's patching). The class is patched here once, when the variable is set; readers made while it
    is unset keep vLLM's behaviour, as does a vLLM without the class. Never raises."""
    import multiprocessing

    if not _spin_from_env()[0]:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    if getattr(SpinCondition.__init__, "_weight_bridge", False):
        return
    init, wait = SpinCondition.__init__, SpinCondition.wait

    def __init__(self: Any, is_reader: bool, *args: Any, **kwargs: Any) -> None:
        init(self, is_reader, *args, **kwargs)
        recheck, seconds = _spin_from_env() if is_reader else (False, None)
        if recheck:
            self._weight_bridge_recheck = True
            if seconds is not None and not multiprocessing.current_process().name.startswith("VllmWorker"):
                self.busy_loop_s = seconds

    def recheck(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "_weight_bridge_recheck", False):
            timeout_ms = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        wait(self, timeout_ms=timeout_ms)

    __init__._weight_bridge = True  # type: ignore[attr-defined]
    SpinCondition.__init__ = __init__  # type: ignore[method-assign]
    SpinCondition.wait = recheck  # type: ignore[method-assign]
