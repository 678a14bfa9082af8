"""Registration of the ``weight_bridge`` backend in vLLM's weight-transfer factories.

``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls it in every process it
starts (the API server or ``LLM`` process, the engine core, each worker). The backend's classes are named by
module path and imported only when vLLM makes one. Idempotent; never raises (a plugin that raises stops vLLM).

``ADAPTER_ROUTE`` is the ``vllm serve`` route of the ``vllm.endpoint_plugins`` entry point of the same name
(inference_side/vllm_adapters.py; vLLM loads it only when ``VLLM_PLUGINS`` names ``weight_bridge``): it makes
a LoRA adapter version the backend verified serveable under the adapter's name.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND = "weight_bridge"
WORKER_ENGINE = ("inference_side.vllm_backend", "WeightBridgeEngine")
TRAINER_ENGINE = ("trainer_side.vllm_backend", "WeightBridgeTrainerEngine")
ADAPTER_ROUTE = "/weight_bridge/adapters"  # POST {name, version, path}: serve a verified adapter version; GET: list


def register() -> None:
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
