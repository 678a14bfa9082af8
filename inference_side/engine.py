"""Starting a vLLM engine with the weight-sync worker extension, with the CPU defaults every engine start of the project
uses (``bridge.cores.cpu_engine_env``)."""

from __future__ import annotations

import logging
import os
from typing import Any

from bridge.cores import cpu_engine_env

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "inference_side.worker_ext.WeightSyncWorker"


def apply_cpu_defaults(tp_size: int) -> None:
    """vLLM's CPU backend reads its settings from the environment; set what a small box needs
    (``bridge.cores.cpu_engine_env``)."""
    cpu_engine_env(tp_size, os.environ)


def start_llm(model: str, tensor_parallel_size: int, dtype: str, llm_kwargs: dict[str, Any],
              engine_core_spin_s: float | str | None = None, recheck: bool = False) -> Any:
    """A ``vllm.LLM`` with the weight-sync worker extension (``llm_kwargs["worker_extension_cls"]`` may name a
    subclass of it) and this machine's CPU defaults; ``llm_kwargs`` override the defaults.
    ``engine_core_spin_s`` (seconds; ``"auto"``: ``AUTO_ENGINE_CORE_SPIN_S`` on CPU, None elsewhere; None leaves
    vLLM's) goes to the engine core through ``WEIGHT_BRIDGE_ENGINE_CORE_SPIN_S`` (bridge/vllm_plugin.py), set in
    this process's environment only while the engine starts. ``recheck`` (the TP workers' spin is shortened:
    ``serve.worker_idle_spin_s``) sets it to ``vllm`` where the engine core keeps vLLM's spin, so every
    reader still rechecks its queue every millisecond."""
    from vllm import LLM
    from vllm.platforms import current_platform

    kwargs: dict[str, Any] = {"skip_tokenizer_init": True, "max_model_len": 256, "max_num_seqs": 8,
                              "worker_extension_cls": WORKER_EXTENSION}
    if current_platform.is_cpu():
        apply_cpu_defaults(tensor_parallel_size)
        kwargs["enforce_eager"] = True
    kwargs.update(llm_kwargs)
    if engine_core_spin_s == "auto":
        from bridge.config import AUTO_ENGINE_CORE_SPIN_S

        engine_core_spin_s = AUTO_ENGINE_CORE_SPIN_S if current_platform.is_cpu() else None
    logger.info("starting vLLM engine for %s (tp=%s, dtype=%s)", model, tensor_parallel_size, dtype)
    value = None if engine_core_spin_s is None else repr(float(engine_core_spin_s))  # type: ignore[arg-type]
    if value is None and recheck:
        from bridge.vllm_plugin import KEEP_SPIN

        value = KEEP_SPIN
    if value is None:
        return LLM(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,  # type: ignore[arg-type]
                   **kwargs)
    from bridge.vllm_plugin import ENGINE_CORE_SPIN_ENV, _tune_engine_core_spin

    previous = os.environ.get(ENGINE_CORE_SPIN_ENV)
    os.environ[ENGINE_CORE_SPIN_ENV] = value
    try:
        _tune_engine_core_spin()  # an engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) is tuned too
        return LLM(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,  # type: ignore[arg-type]
                   **kwargs)
    finally:
        if previous is None:
            os.environ.pop(ENGINE_CORE_SPIN_ENV, None)
        else:
            os.environ[ENGINE_CORE_SPIN_ENV] = previous
