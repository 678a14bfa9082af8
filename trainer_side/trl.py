"""TRL's trainers in server mode, with their weights taken through weight-bridge.

TRL 1.16's ``VLLMClient`` generates through ``vllm serve``'s OpenAI routes and syncs weights through vLLM's
weight-transfer routes, but its ``init_communicator`` / ``update_named_params`` hard-code vLLM's NCCL backend
(a CUDA device, a trainer rank joining the workers' process group). ``WeightBridgeVLLMClient`` keeps every
generation route and replaces only the weight sync: ``init_communicator`` opens a ``WeightBridgeTrainerEngine``
over vLLM's ``HTTPVLLMWeightSyncClient`` (the server must run ``--weight-transfer-config '{"backend":
"weight_bridge"}'`` with ``VLLM_SERVER_DEV_MODE=1``), and each ``update_named_params`` call (one TRL sync:
every parameter) publishes one verified version. Any device works, the CPU included.

``use_weight_bridge()`` makes the trainers use it: TRL builds its client in one place
(``trl.generation.vllm_generation.VLLMClient``: GRPO, tested; RLOO and the distillation trainers too), so
while the ``with`` block constructs the trainer, that name is this class::

    with use_weight_bridge():
        trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...), ...)
    trainer.train()

This module needs ``trl`` (imported here, at the top: the client is a subclass of TRL's); nothing else of
the project imports it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from trl.generation.vllm_client import VLLMClient

from bridge.errors import BridgeError, ConfigError
from bridge.vllm_plugin import BACKEND
from trainer_side.vllm_backend import WeightBridgeInitInfo, WeightBridgeTrainerEngine

__all__ = ["WeightBridgeVLLMClient", "use_weight_bridge"]


class WeightBridgeVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` whose weight sync runs through weight-bridge instead of NCCL.

    Contract: one ``update_named_params`` / ``update_model_params`` call, or one ``with weight_update():``
    block of ``update_named_param`` calls, is one version (1, 2, ... from ``init_info.first_version``),
    applied whole or refused: a refused update raises ``UpdateFailed`` (each worker's ``FailureKind`` and
    reason; the server's state afterwards is the backend's, README "Guarantees and limits"); a block left by
    an exception publishes nothing. ``engine.version`` is the last version the server applied (``/weight_info`` names it).

    ``init_info`` defaults to ``WeightBridgeInitInfo(rank=0)`` with ``host`` = the server's host; its
    ``tp_size`` is always read from the server (each TP worker listens on ``host:base_port + rank``).
    """

    def __init__(self, *args: Any, init_info: WeightBridgeInitInfo | None = None, **kwargs: Any) -> None:
        self.init_info = init_info
        self.engine: WeightBridgeTrainerEngine | None = None
        self._pending: list[tuple[str, Any]] | None = None  # inside weight_update(): the version being gathered
        super().__init__(*args, **kwargs)

    # ---- set-up and tear-down ---------------------------------------------------------------------------
    def init_communicator(self, device: Any = 0) -> None:
        """Open the weight-bridge trainer engine on the server's workers (``device`` is not used: weights
        leave the trainer from wherever they are). Raises ``ConfigError`` naming the setting when the server
        runs another weight-transfer backend or a layout the backend does not serve (data or pipeline
        parallel)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        config = self.get_server_info()
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise ConfigError(
                f"the vLLM server at {self.base_url} runs weight-transfer backend {backend!r}; start it with "
                f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' (and VLLM_SERVER_DEV_MODE=1)")
        parallel = config.get("parallel_config") or {}
        for key in ("data_parallel_size", "pipeline_parallel_size"):
            if int(parallel.get(key) or 1) > 1:
                raise ConfigError(f"the vLLM server at {self.base_url} runs {key}={parallel[key]}; the "
                                  f"{BACKEND} backend serves tensor parallelism only")
        info = self.init_info or WeightBridgeInitInfo(rank=0, host=socket.gethostbyname(self.host or "127.0.0.1"))
        info = dataclasses.replace(info, tp_size=int(parallel.get("tensor_parallel_size") or 1))
        self.close_communicator()
        self.engine = WeightBridgeTrainerEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(self.base_url), source=None)
        atexit.register(self.close_communicator)

    def close_communicator(self) -> None:
        """Close the publisher's connections to the workers (idempotent)."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
        self.communicator = None

    # ---- weight sync --------------------------------------------------------------------------------------
    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterable[tuple[str, Any]]) -> None:
        """Publish ``named_params`` (described by ``metadata``: one ``(name, dtype, shape)`` per tensor, in
        order) as one version; inside ``weight_update()`` they join the version published at its end.
        Raises ``BridgeError`` when the tensors do not match ``metadata``."""
        named = list(named_params)
        _check_metadata(metadata, named)
        if self._pending is not None:
            self._pending.extend(named)
        else:
            self._publish(named)

    def update_named_param(self, name: str, weights: Any) -> None:
        """One tensor, gathered into the version of the enclosing ``weight_update()`` block. Outside such
        a block it raises ``ConfigError``: a lone tensor is not a version."""
        if self._pending is None:
            raise ConfigError("weight-bridge publishes whole versions: call update_named_param inside "
                              "`with client.weight_update():` (one version when the block ends), or "
                              "update_named_params / update_model_params")
        self._pending.append((name, weights))

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """Gather the ``update_named_param(s)`` calls of the block into one version, published when the
        block ends without an exception (with one, nothing is published)."""
        if self._pending is not None:
            raise BridgeError("weight_update() blocks do not nest")
        self._pending = []
        try:
            yield
            named = self._pending
        finally:
            self._pending = None
        self._publish(named)

    def _publish(self, named: list[tuple[str, Any]]) -> None:
        if self.engine is None:
            raise BridgeError("weight-bridge: call init_communicator() before syncing weights")
        if not named:
            raise BridgeError("weight-bridge: nothing to publish (no tensors were given)")
        self.engine.source = named  # type: ignore[assignment]  # any iterable of (name, tensor) publishes
        try:
            self.engine.send_weights()
        finally:
            self.engine.source = None  # hold no reference to the trainer's tensors between syncs


def _check_metadata(metadata: list[tuple[str, str, list[int]]], named: list[tuple[str, Any]]) -> None:
    if len(metadata) != len(named):
        raise BridgeError(f"weight-bridge: {len(named)} tensors given for {len(metadata)} announced")
    for (want, _dtype, shape), (name, tensor) in zip(metadata, named, strict=True):
        if want != name or list(tensor.shape) != list(shape):
            raise BridgeError(f"weight-bridge: tensor {name!r} {list(tensor.shape)} given where {want!r} "
                              f"{list(shape)} was announced")


@contextmanager
def use_weight_bridge(init_info: WeightBridgeInitInfo | None = None) -> Iterator[None]:
    """While the block runs, TRL trainers built in server mode (``use_vllm=True, vllm_mode="server"``) get
    a ``WeightBridgeVLLMClient`` (with ``init_info``) instead of TRL's NCCL one; the client stays with the
    trainer (``trainer.vllm_generation.vllm_client``) after the block. Not thread-safe: it swaps a module
    attribute of ``trl.generation.vllm_generation``."""
    import trl.generation.vllm_generation as generation

    original = generation.VLLMClient
    generation.VLLMClient = functools.partial(WeightBridgeVLLMClient, init_info=init_info)  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        generation.VLLMClient = original  # type: ignore[misc]
