"""Read-only dashboard, JSON API and Prometheus ``/metrics`` of weight-bridge.

``make_app`` builds the FastAPI app over a ``MetricsHub``; ``DashboardService`` runs it in a background
thread; ``Poller`` feeds the hub from engines' ``status()``/``records()``.
"""

from __future__ import annotations

from apps.dashboard.app import DashboardError, make_app
from apps.dashboard.poller import NamedActorSource, Poller, Source, ray_source, server_source
from apps.dashboard.service import DashboardService

__all__ = ["DashboardError", "DashboardService", "NamedActorSource", "Poller", "Source", "make_app",
           "ray_source", "server_source"]
