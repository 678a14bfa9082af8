"""Read-only dashboard, JSON API and Prometheus ``/metrics`` of weight-bridge.

``make_app`` builds the FastAPI app over a ``MetricsHub``; ``DashboardService`` runs it in a background
thread; ``Poller`` feeds the hub from engines' ``status()``/``records()`` (``ReceiverSource``: over a
receiver's endpoint, e.g. an engine behind ``vllm serve``).
"""

from __future__ import annotations

from apps.dashboard.app import DashboardError, make_app
from apps.dashboard.poller import NamedActorSource, Poller, ReceiverSource, Source, ray_source, server_source
from apps.dashboard.service import DashboardService

__all__ = ["DashboardError", "DashboardService", "NamedActorSource", "Poller", "ReceiverSource", "Source", "make_app",
           "ray_source", "server_source"]
