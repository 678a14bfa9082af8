"""Inference side: the Ray actor that owns a vLLM engine, and the worker extension inside it.

``InferenceActor`` and ``RelayActor`` (a host-local relay, ``inference_side/relay.py``) are built lazily
so that importing this package does not import Ray or vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InferenceActor", "InferenceServer", "Relay", "RelayActor"]


def __getattr__(name: str) -> Any:
    if name == "InferenceActor":
        import ray

        from inference_side.server import InferenceServer

        actor = ray.remote(num_cpus=0, max_concurrency=8)(InferenceServer)  # type: ignore[call-overload]
        globals()["InferenceActor"] = actor
        return actor
    if name == "RelayActor":
        import ray

        from inference_side.relay import Relay

        relay = ray.remote(num_cpus=0, max_concurrency=4)(Relay)  # type: ignore[call-overload]
        globals()["RelayActor"] = relay
        return relay
    if name == "Relay":
        from inference_side.relay import Relay

        return Relay
    if name == "InferenceServer":
        from inference_side.server import InferenceServer

        return InferenceServer
    raise AttributeError(name)
