"""Run the dashboard app with uvicorn, in a background thread or in the foreground.

``DashboardService(hub).start()`` binds loopback by default; port 0 picks a free port (see ``.url``).
The ``Poller`` that feeds the hub from engines lives in ``apps.dashboard.poller``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import uvicorn

from apps.dashboard.app import DashboardError, make_app
from apps.dashboard.poller import NamedActorSource, Poller, Source, ray_source, server_source
from apps.metrics import MetricsHub
from bridge.config import ServeConfig

logger = logging.getLogger(__name__)

__all__ = ["DashboardError", "DashboardService", "NamedActorSource", "Poller", "Source", "ray_source", "server_source"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # accept connections (queued) from now on, before uvicorn's loop runs
    except OSError as exc:
        sock.close()
        raise DashboardError(f"cannot bind the dashboard to {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


class DashboardService:
    """The dashboard, JSON API and ``/metrics`` of one hub, served by uvicorn."""

    def __init__(self, hub: MetricsHub, host: str = ServeConfig.host, port: int = ServeConfig.port,
                 sources: Sequence[Source] = (), poll_interval_s: float = 1.0) -> None:
        self.hub = hub
        self.host = host
        self.port = port
        self._app = make_app(hub, sources=sources, poll_interval_s=poll_interval_s)
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _prepare(self) -> tuple[uvicorn.Server, socket.socket]:
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="on")
        self._server, self._socket = uvicorn.Server(config), sock
        return self._server, sock

    def start(self, timeout_s: float = 10.0) -> DashboardService:
        """Serve in a daemon thread; return once the server accepts connections."""
        if self._thread is not None:
            return self
        server, sock = self._prepare()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="weight-bridge-dashboard",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise DashboardError(f"dashboard did not start on {self.url} within {timeout_s}s")
            time.sleep(0.02)
        logger.info("dashboard serving at %s", self.url)
        return self

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve in this thread until SIGINT/SIGTERM (uvicorn handles the signals).

        ``on_ready(url)`` is called once the address is bound (useful with port 0)."""
        server, sock = self._prepare()
        logger.info("dashboard serving at %s", self.url)
        if on_ready is not None:
            on_ready(self.url)
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("dashboard thread did not stop within %ss", timeout_s)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> DashboardService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
