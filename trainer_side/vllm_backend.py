"""The ``weight_bridge`` backend of vLLM's weight-transfer API, trainer side.

``WeightTransferTrainerFactory.trainer_init(WeightBridgeInitInfo(rank=0), client=..., source=...)`` picks
this engine by the init info's ``backend``; it works with vLLM's clients (``HTTPVLLMWeightSyncClient`` against
``vllm serve``, ``RayVLLMWeightSyncClient`` against Ray-held engines) and any ``WeightSource``. Each
``send_weights()`` publishes one version with the project's ``WeightPublisher`` to the receivers that the
engine's workers opened (inference_side/vllm_backend.py), while vLLM's ``update_weights`` call holds every
worker in the update: start -> update_weights (on a helper thread) + publish -> finish(version).

``send_adapter(tensors, adapter)`` publishes a LoRA adapter version the same way (only the adapter's tensors,
verified by every worker against the engine's LoRA configuration; the base weights and their version label do
not move), then asks ``vllm serve``'s adapter route (``bridge.vllm_plugin.ADAPTER_ROUTE``) to serve it under the
adapter's name.

Importing this module registers the backend in vLLM's factories (a trainer process does not load vLLM's
plugins).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from bridge import wire
from bridge.config import config_from_dict
from bridge.errors import BridgeError, UpdateFailed
from bridge.report import FailureKind
from bridge.sender import PublishReport
from bridge.vllm_plugin import ADAPTER_ROUTE, BACKEND, register
from trainer_side.publisher import WeightPublisher

register()
logger = logging.getLogger(__name__)


@dataclass
class WeightBridgeInitInfo(TrainerInitInfo):
    """Every field but ``rank`` has a default, so ``WeightBridgeInitInfo(rank=0)`` works against a local
    engine. The workers listen on ``host``: ``base_port`` + TP rank (``tp_size`` of them); ``config`` is a
    ``BridgeConfig`` as a dict (transport kind, sync mode, deadlines ...), sent to the workers too; ``lora_dir``:
    where TP rank 0 writes the LoRA adapter versions it verified, on the server's host ("": a temporary directory,
    removed when the worker exits normally)."""

    backend: ClassVar[str] = BACKEND
    host: str = "127.0.0.1"
    base_port: int = 47310
    tp_size: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    lora_dir: str = ""
    first_version: int = 1
    update_timeout_s: float = 600.0
    # vllm serve (an HTTP client): pause generation this way around each update ("keep": requests in flight
    # freeze and continue afterwards; "wait": they finish on the old weights first; "abort": they end; None:
    # no pause). Afterwards the prefix cache is reset, running requests recomputed on the new weights.
    pause: str | None = "keep"

    def endpoints(self) -> list[str]:
        return [f"tcp://{self.host}:{self.base_port + rank}" for rank in range(self.tp_size)]


class WeightBridgeTrainerEngine(TrainerWeightTransferEngine[WeightBridgeInitInfo]):
    init_info_cls = WeightBridgeInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 init_info: WeightBridgeInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info or WeightBridgeInitInfo(rank=0)
        self.version = self.init_info.first_version - 1
        self.last_report: PublishReport | None = None
        self.adapter_versions: dict[str, int] = {}  # adapter name -> the last version sent and served
        self._publisher: WeightPublisher | None = None

    @classmethod
    def trainer_init(cls, init_info: WeightBridgeInitInfo, *, client: Any, source: Any = None) -> WeightBridgeTrainerEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine({"base_port": init_info.base_port, "bind_host": init_info.host,
                                                "config": dict(init_info.config),
                                                **({"lora_dir": init_info.lora_dir} if init_info.lora_dir else {})})
            engine._publisher = WeightPublisher(init_info.endpoints(), config=config_from_dict(init_info.config))
        return engine

    def send_weights(self, version: int | None = None) -> None:
        """Publish ``source`` as ``version`` (default: the next one), then ``finish_weight_update(version)``.
        Raises ``UpdateFailed`` (each worker's reason and ``FailureKind``) when the engine refused it: vLLM's
        session is closed without a version and the engine keeps serving its own."""
        if self.source is None:
            raise BridgeError("weight_bridge: trainer_init was given no source")
        if not self.is_sender or self._publisher is None:
            for _ in self.source:  # every rank iterates: materializing sharded tensors is a collective
                pass
            return
        version = self.version + 1 if version is None else version
        with _Paused(self.client, self.init_info.pause):
            self._send(version, self.source)

    def send_adapter(self, weights: Any, adapter: wire.AdapterSpec, version: int | None = None) -> dict[str, Any]:
        """Publish LoRA adapter ``adapter``: ``weights`` are its tensors alone, named as PEFT saves them
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ...; a state dict or (name, tensor)
        pairs), as its ``version`` (default: the next one; each adapter counts its own, apart from the base's).
        Every worker verifies it like a full update (checksums, finiteness, versions) and against the engine's
        LoRA configuration; nothing of the base weights moves. Then, over HTTP (``vllm serve``), the server serves
        it under ``adapter.name``: the answer of its adapter route (``{"served": "math@v2", ...}``). With another
        client (an ``LLM``) the answer is ``{"name", "version", "path"}``: the verified PEFT directory, for a
        ``LoRARequest``. Raises ``UpdateFailed`` naming the problem (a refused update: each worker's reason and
        ``update_weights``' answer; a refused route: ``reasons["adapter_route"]``, the HTTP status and reason); the
        previous adapter version serves on (after a refused route the workers hold the version: the next one
        follows it). No pause: requests in flight keep the adapter version they began with."""
        if not self.is_sender or self._publisher is None:
            return {}
        version = self.adapter_versions.get(adapter.name, 0) + 1 if version is None else version
        self._send(version, weights, adapter)
        assert self.last_report is not None
        path = next((str(e.engine["adapter_dir"]) for e in self.last_report.engines if e.engine.get("adapter_dir")), "")
        noop = all(e.noop for e in self.last_report.engines)
        self.adapter_versions[adapter.name] = version  # the workers hold it: the next default version is the one after
        return self._serve_adapter(adapter.name, version, path) if path or not noop else {"noop": True}

    def _serve_adapter(self, name: str, version: int, path: str) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        if not isinstance(self.client, HTTPVLLMWeightSyncClient):
            return {"name": name, "version": version, "path": path}
        import requests

        url = f"{self.client.base_url}{ADAPTER_ROUTE}"
        try:
            r = requests.post(url, json={"name": name, "version": version, "path": path}, timeout=self.client.timeout)
        except requests.RequestException as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise UpdateFailed(f"adapter {name} version {version}: verified, but {url} did not answer: {why}",
                               {"adapter_route": why}, {"adapter_route": FailureKind.TRANSPORT}) from exc
        if r.status_code != 200:
            answered = f"HTTP {r.status_code}: {r.text[:2000]}"
            hint = (" (the server loads the route when VLLM_PLUGINS names weight_bridge)" if r.status_code == 404 else "")
            kind = FailureKind.VERSION if r.status_code == 409 else FailureKind.LOAD
            raise UpdateFailed(f"adapter {name} version {version}: verified, but the server did not serve it: "
                               f"{answered}{hint}", {"adapter_route": answered}, {"adapter_route": kind})
        answer: dict[str, Any] = r.json()
        return answer

    def _send(self, version: int, weights: Any, adapter: wire.AdapterSpec | None = None) -> None:
        assert self._publisher is not None and weights is not None
        publisher = self._publisher
        self.client.start_weight_update()
        failure: list[BaseException] = []
        info: dict[str, Any] = {"version": version, "timeout_s": self.init_info.update_timeout_s}
        if adapter is not None:
            info["adapter"] = adapter.name

        def hold() -> None:
            try:
                self.client.update_weights(info)
            except BaseException as exc:  # noqa: BLE001 - reported after the publish
                failure.append(exc)

        holder = threading.Thread(target=hold, name="wb-update-weights", daemon=True)
        holder.start()
        error: BaseException | None = None
        try:
            named = weights.items() if isinstance(weights, dict) else weights
            self.last_report = publisher.publish(iter(named), version, adapter=adapter)
        except BaseException as exc:  # noqa: BLE001 - raised below, once vLLM's session is closed
            error = exc
        holder.join(self.init_info.update_timeout_s + 30)
        if error is None and not failure and not holder.is_alive():
            if adapter is not None:  # the base's label (/weight_info) stays
                self.client.finish_weight_update()
            else:
                self.client.finish_weight_update(str(version))
                self.version = version
            return
        self._close_session()
        if isinstance(error, UpdateFailed) and failure:  # the engine's own answer to update_weights, beside the acks'
            answered = _answer(failure[0])
            raise UpdateFailed(f"{error}; vLLM's update_weights answered: {answered}",
                               {**error.reasons, "update_weights": answered}, error.kinds) from error
        if error is not None:
            raise error
        why = _answer(failure[0]) if failure else "update_weights did not return"
        raise UpdateFailed(f"version {version}: the engine's update_weights failed after the publish: {why}",
                           {"update_weights": why})

    def _close_session(self) -> None:
        """End vLLM's update session without a version after a failed update. The worker that raised in
        ``update_weights`` has closed its own session already and answers this call with an error; expected."""
        try:
            self.client.finish_weight_update()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            logger.debug("weight_bridge: finish_weight_update after a failed update: %s", _answer(exc))

    def shutdown(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


def _answer(exc: BaseException) -> str:
    """What the engine answered: an HTTP error's status and body, else the exception's text."""
    response = getattr(exc, "response", None)
    if response is not None:
        return f"HTTP {response.status_code}: {response.text[:2000]}"
    return f"{type(exc).__name__}: {exc}"


class _Paused:
    """Around one update: pause generation (``vllm serve``), then reset the prefix cache, preempting running
    requests so they recompute their KV on the new weights, and resume. ``LLM`` engines (Ray client) run no
    request during the update calls; their prefix cache is reset afterwards."""

    def __init__(self, client: Any, mode: str | None) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

        self.client, self.mode = client, mode
        self.http = client if isinstance(client, HTTPVLLMWeightSyncClient) else None
        self.ray = client if isinstance(client, RayVLLMWeightSyncClient) else None

    def _post(self, path: str, **params: Any) -> Any:
        import requests

        assert self.http is not None
        r = requests.post(f"{self.http.base_url}/{path}", params=params, timeout=self.http.timeout)
        r.raise_for_status()
        return r.json() if r.content else {}

    def __enter__(self) -> None:
        if self.http is not None and self.mode:
            self._post("pause", mode=self.mode)

    def __exit__(self, *exc: object) -> None:
        if self.http is not None:
            try:
                self._post("reset_prefix_cache", reset_running_requests="true")
            finally:
                if self.mode:
                    self._post("resume")
        elif self.ray is not None:
            import ray

            ray.get([h.reset_prefix_cache.remote() for h in self.ray.handles])


__all__ = ["WeightBridgeInitInfo", "WeightBridgeTrainerEngine"]
