"""``vllm serve``'s adapter route: a LoRA adapter version the ``weight_bridge`` backend verified becomes serveable
under the adapter's name, on the running server, without touching the base weights.

vLLM's own runtime LoRA route (``/v1/load_lora_adapter``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) cannot give a name
its newest version: loading again under a served name needs ``load_inplace``, which keeps the LoRA id, and vLLM
0.32 then reloads that adapter from its directory on every engine step of every request that carries it (a
request still on the old version reloads the old directory, so the batch flips between versions; read in vLLM's
source: ``lora/worker_manager.py`` ``LRUCacheWorkerLoRAManager.add_adapter``). This route
instead loads each version under its own LoRA id and name (``math@v2``) through the engine client's ``add_lora``
(vLLM loads and checks it; a refusal leaves everything as it was), then points the served name (``math``) at it
in one step in the server's table of adapters, and removes the previous version's id from the engine.

- ``POST /weight_bridge/adapters`` ``{"name": "math", "version": 2, "path": DIR}``: ``DIR`` must be a directory
  the backend wrote and marked (inference_side/lora.py ``MARKER``) for that adapter version, and the version newer
  than the one served (the same version: a no-op). Answers ``{"served": "math@v2", "lora_int_id": N, ...}``;
  400 (not a verified directory of that version, a base model's name), 409 (an older version), 500 (vLLM
  could not load it), each with the reason; then the previous version serves on.
- ``GET /weight_bridge/adapters``: ``{"math": {"version": 2, "served": "math@v2", "path": DIR, "lora_int_id": N}}``.

A request names the adapter in the OpenAI ``model`` field (``"model": "math"``); the version that served it is in
the answer's ``model`` field (``"math@v2"``): vLLM reports the name of the LoRA request it ran. A request keeps
the version it was admitted with to its end (its LoRA id, reloaded from its directory if vLLM evicted it).

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them: ``VLLM_PLUGINS=weight_bridge`` (the backend's
general plugin has the same name, and ``VLLM_PLUGINS`` filters both groups).
"""

from __future__ import annotations

import logging
from argparse import Namespace
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import JSONResponse

from bridge.errors import ManifestError, VersionError
from bridge.vllm_plugin import ADAPTER_ROUTE, BACKEND
from inference_side.lora import check_activation, read_marker

logger = logging.getLogger(__name__)


class AdapterRoutes:
    """The ``vllm.endpoint_plugins`` entry point ``weight_bridge`` (vLLM's ``EndpointPlugin`` protocol)."""

    name = BACKEND
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        @router.post(ADAPTER_ROUTE)
        async def serve_adapter(raw_request: Request) -> JSONResponse:
            try:
                body = await raw_request.json()
                name, version, path = str(body["name"]), int(body["version"]), str(body["path"])
            except (ValueError, KeyError, TypeError) as exc:
                status, answer = _error(HTTPStatus.BAD_REQUEST, f"ManifestError: the body must be a JSON map with name, "
                                        f"version and path: {type(exc).__name__}: {exc}")
                return JSONResponse(answer, status_code=status)
            status, answer = await self.serve(raw_request.app.state.openai_serving_models, name, version, path)
            return JSONResponse(answer, status_code=status)

        @router.get(ADAPTER_ROUTE)
        async def list_adapters(raw_request: Request) -> JSONResponse:
            return JSONResponse(served_adapters(raw_request.app.state.openai_serving_models))

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        self.engine_client = engine_client

    async def serve(self, models: Any, name: str, version: int, path: str) -> tuple[int, dict[str, Any]]:
        """Serve ``path`` as adapter ``name`` version ``version`` (see the module's docstring): (HTTP status, answer)."""
        from vllm.lora.request import LoRARequest

        if self.engine_client is None:
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, f"adapter {name}: this server has no engine")
        if models.is_base_model(name):
            return _error(HTTPStatus.BAD_REQUEST, f"ManifestError: adapter {name}: the name is a served base model's")
        async with models.lora_resolver_lock[name]:  # vLLM's own per-name lock for its LoRA routes
            old = models.lora_requests.get(name)
            served = _version_of(old, name)
            try:
                noop = check_activation(read_marker(Path(path)), path, name, version, served)
            except VersionError as exc:
                return _error(HTTPStatus.CONFLICT, f"VersionError: {exc}")
            except ManifestError as exc:
                return _error(HTTPStatus.BAD_REQUEST, f"ManifestError: {exc}")
            if noop:
                return HTTPStatus.OK, {"noop": True, "reason": noop, **_describe(name, old)}
            new = LoRARequest(lora_name=f"{name}@v{version}", lora_int_id=models.lora_id_counter.inc(1), lora_path=path)
            try:
                await self.engine_client.add_lora(new)
            except Exception as exc:  # noqa: BLE001 - vLLM's refusal, named; the previous version serves on
                keeps = f"version {served} serves on" if served is not None else "no version of it is served"
                return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"LoadError: adapter {name} version {version} could not be "
                              f"loaded by vLLM: {type(exc).__name__}: {exc} ({keeps})")
            models.lora_requests[name] = new  # from here on, requests naming the adapter get this version
            if old is not None:
                try:
                    await self.engine_client.remove_lora(old.lora_int_id)
                except Exception as exc:  # noqa: BLE001 - the new version serves; the old id only lingers
                    logger.warning("weight_bridge: removing LoRA id %s (%s) failed: %s", old.lora_int_id, old.lora_name, exc)
            logger.info("weight_bridge: adapter %s serves version %s (%s, LoRA id %s)", name, version, path, new.lora_int_id)
            return HTTPStatus.OK, _describe(name, new)


def served_adapters(models: Any) -> dict[str, Any]:
    """Adapter name -> what this route serves under it (names vLLM's own routes loaded are left out)."""
    out = {}
    for name, request in sorted(models.lora_requests.items()):
        if _version_of(request, name) is not None:
            out[name] = _describe(name, request)
    return out


def _version_of(request: Any, name: str) -> int | None:
    """The adapter version a LoRA request this route made for ``name`` serves (None: not one of them)."""
    if request is None:
        return None
    head, _, tail = str(request.lora_name).rpartition("@v")
    return int(tail) if head == name and tail.isdigit() else None


def _describe(name: str, request: Any) -> dict[str, Any]:
    return {"name": name, "version": _version_of(request, name), "served": request.lora_name,
            "lora_int_id": request.lora_int_id, "path": request.lora_path}


def _error(status: HTTPStatus, reason: str) -> tuple[int, dict[str, Any]]:
    return int(status), {"error": reason}


__all__ = ["AdapterRoutes", "served_adapters"]
