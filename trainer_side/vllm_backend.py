"""The ``weight_bridge`` backend of vLLM's weight-transfer API, trainer side.

``WeightTransferTrainerFactory.trainer_init(WeightBridgeInitInfo(rank=0), client=..., source=...)`` picks
this engine by the init info's ``backend``; it works with vLLM's clients (``HTTPVLLMWeightSyncClient`` against
``vllm serve``, ``RayVLLMWeightSyncClient`` against Ray-held engines) and any ``WeightSource``. Each
``send_weights()`` publishes one version with the project's ``WeightPublisher`` to the receivers that the
engine's workers opened (inference_side/vllm_backend.py), while vLLM's ``update_weights`` call holds every
worker in the update: start -> update_weights (on a helper thread) + publish -> finish(version).

Many trainer ranks (``WeightBridgeInitInfo(rank=r, trainer_ranks=N)`` on every rank of a torchrun / FSDP2 trainer,
``ShardSource(model)``): every rank calls ``send_weights()`` and sends its own shards with ``RankedPublisher``
(trainer_side/multi_rank.py; no rank gathers a tensor), rank 0 alone drives vLLM's client (vLLM's trainer engines
treat ranks so: rank 0 is the sender of the control calls) around the publish, and every rank returns or raises the
same outcome. ``trainer_ranks=1`` (the default) keeps one sending rank: rank 0 publishes whole tensors, the others
only iterate the source (joining its gathers).

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from bridge import wire
from bridge.config import config_from_dict
from bridge.errors import BridgeError, ConfigError, UpdateFailed
from bridge.report import FailureKind, describe
from bridge.sender import PublishReport
from bridge.vllm_plugin import ADAPTER_ROUTE, BACKEND, register
from trainer_side.multi_rank import RankedPublisher
from trainer_side.publisher import WeightPublisher

register()
logger = logging.getLogger(__name__)


@dataclass
class WeightBridgeInitInfo(TrainerInitInfo):
    """Every field but ``rank`` has a default, so ``WeightBridgeInitInfo(rank=0)`` works against a local
    engine. The workers listen on ``host``: ``base_port`` + TP rank (``tp_size`` of them); ``config`` is a
    ``BridgeConfig`` as a dict (transport kind, sync mode, deadlines ...), sent to the workers too; ``lora_dir``:
    where TP rank 0 writes the LoRA adapter versions it verified, on the server's host ("": a temporary directory,
    removed when the worker exits normally).

    ``trainer_ranks``: how many trainer ranks send. 1 (default): rank 0 sends every tensor whole, the other ranks
    only iterate the source. N > 1: every rank of ``group`` (a torch.distributed process group of N ranks, default
    the world, made by the caller) builds the engine with its own ``rank`` (its rank in ``group``) and sends its own
    shards (``transport.kind`` zmq or shm; the ranks share one host)."""

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
    trainer_ranks: int = 1
    group: Any = field(default=None, repr=False, compare=False)

    def endpoints(self) -> list[str]:
        return [f"tcp://{self.host}:{self.base_port + rank}" for rank in range(self.tp_size)]


class ShardSource(WeightSource):
    """A ``WeightSource`` over ``module.named_parameters()`` that yields each parameter as this rank holds it: a
    DTensor (FSDP2 ``fully_shard``, tensor parallel) as the DTensor itself, never gathered (the trainer engine sends
    its local shard), a plain tensor as it is. For ``WeightBridgeInitInfo(trainer_ranks=N)``; ``metadata()`` gives
    the full shapes, as ``ModuleSource``'s does. (vLLM's ``ModuleSource`` gathers every DTensor with
    ``full_tensor()`` as it iterates: with many sending ranks rank 0 would then send every tensor whole.)"""

    def __init__(self, module: Any) -> None:
        self._module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self._module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        yield from self._module.named_parameters()


def _check_ranks(info: WeightBridgeInitInfo) -> None:
    """ConfigError unless ``info``'s rank and ``trainer_ranks`` are this process's rank and size of its group."""
    if info.trainer_ranks < 1:
        raise ConfigError(f"weight_bridge: trainer_ranks must be 1 or more, not {info.trainer_ranks}")
    if info.trainer_ranks == 1:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"weight_bridge: trainer_ranks={info.trainer_ranks} needs torch.distributed's process group "
                          f"(torchrun, then dist.init_process_group) on every trainer rank before trainer_init")
    world, rank = dist.get_world_size(info.group), dist.get_rank(info.group)
    if (world, rank) != (info.trainer_ranks, info.rank):
        raise ConfigError(f"weight_bridge: the init info says rank {info.rank} of trainer_ranks={info.trainer_ranks}, "
                          f"but this process is rank {rank} of {world} in its process group")


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
        self._ranked: RankedPublisher | None = None  # trainer_ranks > 1: this rank's share of every publish

    @classmethod
    def trainer_init(cls, init_info: WeightBridgeInitInfo, *, client: Any, source: Any = None) -> WeightBridgeTrainerEngine:
        """Called on every trainer rank. Rank 0 starts the workers' receivers (``init_weight_transfer_engine``).
        With ``trainer_ranks`` > 1 this is a collective over the ranks' group: every rank learns rank 0's answer
        (an error there is raised on every rank) and builds its ``RankedPublisher``."""
        _check_ranks(init_info)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        worker_info = {"base_port": init_info.base_port, "bind_host": init_info.host, "config": dict(init_info.config),
                       **({"lora_dir": init_info.lora_dir} if init_info.lora_dir else {})}
        config = config_from_dict(init_info.config)
        if init_info.trainer_ranks == 1:
            if engine.is_sender:
                client.init_weight_transfer_engine(worker_info)
                engine._publisher = WeightPublisher(init_info.endpoints(), config=config)
            return engine
        import torch.distributed as dist
        from vllm.distributed.weight_transfer.base import ModuleSource

        if isinstance(source, ModuleSource):
            logger.warning("weight_bridge: vLLM's ModuleSource gathers every DTensor (full_tensor) as it iterates; "
                           "with trainer_ranks=%d use trainer_side.vllm_backend.ShardSource(model) to send only each "
                           "rank's own shards", init_info.trainer_ranks)
        failed: BaseException | None = None
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine(worker_info)
            except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
                failed = exc
        answer: list[Any] = [None if failed is None else _answer(failed)]
        group = init_info.group
        dist.broadcast_object_list(answer, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if answer[0] is not None:
            raise BridgeError(f"weight_bridge: trainer rank 0's init_weight_transfer_engine failed: {answer[0]}") from failed
        timeout_s = float(getattr(client, "timeout", 300.0))
        # rank 0's own calls around a publish: pause, start, the update_weights call it waits for, finish, resume
        control_s = init_info.update_timeout_s + 30 + 4 * timeout_s
        engine._ranked = RankedPublisher(init_info.endpoints(), config=config, group=group, control_s=control_s)
        return engine

    def send_weights(self, version: int | None = None, weights: Any = None) -> None:
        """Publish ``source`` (or ``weights``: a state dict or (name, tensor) pairs, for this call) as ``version``
        (default: the next one), then ``finish_weight_update(version)``. Raises ``UpdateFailed`` (each worker's
        reason and ``FailureKind``) when the engine refused it: vLLM's session is closed without a version and the
        engine keeps serving its own.

        With ``trainer_ranks`` > 1, called on every rank with the same version, each with its own view (DTensors:
        their local shards are sent; plain tensors: rank 0 sends them). Rank 0 pauses generation, opens vLLM's
        session and calls ``update_weights`` once the ranks agreed the manifest, and finishes or closes the session
        before the ranks learn the outcome: every rank returns, or raises the same error (``RankFailed`` /
        ``UpdateFailed`` naming a rank that died, went silent or failed its part; ``ShardError``)."""
        weights = self.source if weights is None else weights
        if weights is None:
            raise BridgeError("weight_bridge: trainer_init was given no source and send_weights no weights")
        if self._ranked is not None:
            self._send_ranked(self.version + 1 if version is None else version, weights)
            return
        if not self.is_sender or self._publisher is None:
            for _ in weights:  # every rank iterates: materializing sharded tensors is a collective
                pass
            return
        version = self.version + 1 if version is None else version
        with _Paused(self.client, self.init_info.pause):
            self._send(version, weights)

    def _send_ranked(self, version: int, weights: Any, adapter: wire.AdapterSpec | None = None) -> dict[str, Any]:
        """Every rank: its share of ``version``; rank 0 drives vLLM's session around the publish (``prepare``: pause,
        start, update_weights; ``settle``: finish or close, resume) and the ranks learn the settled outcome. An
        ``adapter`` pauses nothing, leaves ``version`` (the base's) as it is, and is served (``_serve_adapter``)
        inside ``settle``, so a refused route fails every rank; rank 0 returns the route's answer."""
        ranked = self._ranked
        assert ranked is not None
        if not self.is_sender:
            self.last_report = ranked.publish(weights, version, adapter=adapter)
            if adapter is None:
                self.version = version
            return {}
        served: dict[str, Any] = {}
        paused = _Paused(self.client, self.init_info.pause if adapter is None else None)
        session = _Session(self, version, adapter)
        entered = False

        def prepare() -> None:
            nonlocal entered
            if adapter is None:
                paused.pause()
                entered = True
            session.open()

        def settle(outcome: PublishReport | BaseException) -> PublishReport:
            try:
                if session.opened:
                    session.close(outcome if isinstance(outcome, BaseException) else None)
                elif isinstance(outcome, BaseException):
                    raise outcome
                assert isinstance(outcome, PublishReport)
                if adapter is not None:
                    served.update(self._adapter_served(outcome, adapter.name, version))
                return outcome
            finally:
                if entered:
                    paused.resume()

        self.last_report = ranked.publish(weights, version, prepare=prepare, settle=settle, adapter=adapter)
        if adapter is None:
            self.version = version
        return served

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
        follows it). No pause: requests in flight keep the adapter version they began with.

        With ``trainer_ranks`` > 1, called on every rank with the same adapter and version, each with its own view
        of the adapter's tensors (DTensors: their local shards; plain tensors: rank 0's): the ranks assemble it on
        rank 0's host and rank 0 sends it (``RankedPublisher.publish(adapter=...)``); every rank returns or raises
        alike, the served answer on rank 0 (``{}`` on the others)."""
        version = self.adapter_versions.get(adapter.name, 0) + 1 if version is None else version
        if self._ranked is not None:
            try:
                served = self._send_ranked(version, weights, adapter)
            except UpdateFailed as exc:
                if "adapter_route" in exc.reasons:  # refused by the route only: the workers hold the version
                    self.adapter_versions[adapter.name] = version
                raise
            self.adapter_versions[adapter.name] = version
            return served
        if not self.is_sender or self._publisher is None:
            return {}
        self._send(version, weights, adapter)
        assert self.last_report is not None
        return self._adapter_served(self.last_report, adapter.name, version)

    def _adapter_served(self, report: PublishReport, name: str, version: int) -> dict[str, Any]:
        """After every worker took adapter ``name`` ``version`` (``report``): the workers hold it (the next default
        version is the one after), and the server serves it (``_serve_adapter``; ``{"noop": True}`` when every
        worker had it already)."""
        path = next((str(e.engine["adapter_dir"]) for e in report.engines if e.engine.get("adapter_dir")), "")
        noop = all(e.noop for e in report.engines)
        self.adapter_versions[name] = version
        return self._serve_adapter(name, version, path) if path or not noop else {"noop": True}

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
        session = _Session(self, version, adapter)
        session.open()
        error: BaseException | None = None
        try:
            named = weights.items() if isinstance(weights, dict) else weights
            self.last_report = publisher.publish(iter(named), version, adapter=adapter)
        except BaseException as exc:  # noqa: BLE001 - raised below, once vLLM's session is closed
            error = exc
        session.close(error)
        if adapter is None:
            self.version = version

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
        if self._ranked is not None:
            self._ranked.close()
            self._ranked = None


class _Session:
    """vLLM's update session around one publish, on the rank that drives the client: ``open`` calls
    ``start_weight_update``, then ``update_weights`` on a helper thread (every worker serves the update inside that
    call while the publish runs); ``close(error)`` waits for it, then finishes the session with the version (an
    adapter: without one, the base's label stays) or, after a failure, closes it without a version and raises the
    update's error (with vLLM's own answer to ``update_weights`` beside the acks')."""

    def __init__(self, engine: WeightBridgeTrainerEngine, version: int, adapter: wire.AdapterSpec | None = None) -> None:
        self.engine, self.version, self.adapter = engine, version, adapter
        self.failure: list[BaseException] = []
        self.holder: threading.Thread | None = None

    @property
    def opened(self) -> bool:
        return self.holder is not None

    def open(self) -> None:
        client = self.engine.client
        client.start_weight_update()
        info: dict[str, Any] = {"version": self.version, "timeout_s": self.engine.init_info.update_timeout_s}
        if self.adapter is not None:
            info["adapter"] = self.adapter.name

        def hold() -> None:
            try:
                client.update_weights(info)
            except BaseException as exc:  # noqa: BLE001 - reported after the publish
                self.failure.append(exc)

        self.holder = threading.Thread(target=hold, name="wb-update-weights", daemon=True)
        self.holder.start()

    def close(self, error: BaseException | None) -> None:
        """After the publish (``error``: how it failed, None: every engine applied it)."""
        engine, version, failure, holder = self.engine, self.version, self.failure, self.holder
        assert holder is not None, "the session was not opened"
        sender = engine._publisher or engine._ranked
        if error is not None and sender is not None:  # failed before its Begin: the engines stop waiting
            sender.abandon(version, describe(error))
        holder.join(engine.init_info.update_timeout_s + 30)
        if error is None and not failure and not holder.is_alive():
            if self.adapter is not None:  # the base's label (/weight_info) stays
                engine.client.finish_weight_update()
            else:
                engine.client.finish_weight_update(str(version))
            return
        engine._close_session()
        if isinstance(error, UpdateFailed) and failure:  # the engine's own answer to update_weights, beside the acks'
            answered = _answer(failure[0])
            raise UpdateFailed(f"{error}; vLLM's update_weights answered: {answered}",
                               {**error.reasons, "update_weights": answered}, error.kinds) from error
        if error is not None:
            raise error
        why = _answer(failure[0]) if failure else "update_weights did not return"
        raise UpdateFailed(f"version {version}: the engine's update_weights failed after the publish: {why}",
                           {"update_weights": why})


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
        self.pause()

    def __exit__(self, *exc: object) -> None:
        self.resume()

    def pause(self) -> None:
        if self.http is not None and self.mode:
            self._post("pause", mode=self.mode)

    def resume(self) -> None:
        if self.http is not None:
            try:
                self._post("reset_prefix_cache", reset_running_requests="true")
            finally:
                if self.mode:
                    self._post("resume")
        elif self.ray is not None:
            import ray

            ray.get([h.reset_prefix_cache.remote() for h in self.ray.handles])


__all__ = ["ShardSource", "WeightBridgeInitInfo", "WeightBridgeTrainerEngine"]
