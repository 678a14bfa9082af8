"""The read-only FastAPI app: dashboard page, JSON API and Prometheus metrics over one ``MetricsHub``.

Only GET routes exist, so any other method on them answers 405. The page is one static HTML file with
its own inline JS; its Content-Security-Policy forbids loading anything but this app's own JSON.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Response
from fastapi.responses import HTMLResponse

from apps.dashboard.poller import Poller, Source
from apps.metrics import METRICS_CONTENT_TYPE, MetricsHub
from bridge.errors import BridgeError

logger = logging.getLogger(__name__)

INDEX_HTML = Path(__file__).resolve().parent / "static" / "index.html"
PAGE_CSP = ("default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
NO_STORE = {"Cache-Control": "no-store"}


class DashboardError(BridgeError):
    """The dashboard cannot start: its page is missing or its address cannot be bound."""


def _read_page() -> str:
    try:
        return INDEX_HTML.read_text(encoding="utf-8")
    except OSError as exc:
        raise DashboardError(f"dashboard page {INDEX_HTML} is missing: {exc}") from exc


def make_app(hub: MetricsHub, sources: Sequence[Source] = (), poll_interval_s: float = 1.0) -> FastAPI:
    """Build the app; with ``sources``, a ``Poller`` feeds the hub while the app runs."""
    page = _read_page()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        poller = Poller(hub, sources, poll_interval_s).start() if sources else None
        try:
            yield
        finally:
            if poller is not None:
                poller.stop()

    app = FastAPI(title="weight-bridge", summary="Read-only view of weight syncs into vLLM engines",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff",
                                           **NO_STORE})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(hub.render(), media_type=METRICS_CONTENT_TYPE, headers=NO_STORE)

    @app.get("/api/records")
    def records(response: Response, limit: int | None = Query(None, ge=1, description="newest N records"),
                engine: str | None = Query(None, description="only this engine's records")) -> list[dict[str, Any]]:
        response.headers.update(NO_STORE)
        return hub.records(limit=limit, engine=engine)

    @app.get("/api/engines")
    def engines(response: Response) -> dict[str, Any]:
        response.headers.update(NO_STORE)
        return hub.engines()

    @app.get("/healthz")
    def healthz(response: Response) -> dict[str, Any]:
        """Liveness of this service (200 while it runs), with a summary of the engines it knows."""
        response.headers.update(NO_STORE)
        view = hub.engines()
        return {"ok": True, "engines": len(view["engines"]),
                "degraded": [e["engine"] for e in view["engines"] if e["health"] != "ok"]}

    return app
