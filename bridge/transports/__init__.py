"""Data planes behind one small interface, loaded lazily by name.

Control messages (hello, manifest, credits, acks, heartbeats) always travel over ZMQ; the data plane
decides how bucket bytes travel: as ZMQ frames, written once into same-host shared memory, or over a
private gloo/NCCL group (torch.distributed is imported only when such a plane is made).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bridge.errors import ConfigError

if TYPE_CHECKING:
    from bridge.transports.base import SendPlane

_PLANES: dict[str, str] = {
    "zmq": "bridge.transports.zmq_plane:ZmqSendPlane",
    "shm": "bridge.transports.shm_plane:ShmSendPlane",
    "gloo": "bridge.transports.collective_plane:GlooSendPlane",
    "nccl": "bridge.transports.collective_plane:NcclSendPlane",
}


def register_plane(kind: str, target: str) -> None:
    """Register a data plane as ``module:Class`` (imported on first use)."""
    _PLANES[kind] = target


def available() -> list[str]:
    return sorted(_PLANES)


def send_plane(kind: str, **options: Any) -> SendPlane:
    """A new send plane of ``kind``; ``options`` go to its constructor (the collective planes take
    ``host`` and ``timeout_s``)."""
    try:
        target = _PLANES[kind]
    except KeyError as exc:
        raise ConfigError(f"unknown transport {kind!r}; available: {available()}") from exc
    module, _, cls = target.partition(":")
    plane: SendPlane = getattr(importlib.import_module(module), cls)(**options)
    return plane


COLLECTIVE_BACKENDS = ("gloo", "nccl")


def collective_link(kind: str, host: str, port: int, rank: int, world: int, timeout_s: float = 60.0) -> Any:
    """A collective data-plane link (``gloo`` or ``nccl``, see collective_plane.py); torch.distributed
    is imported only here, so nothing on the ZMQ/shm path ever loads it."""
    if kind not in COLLECTIVE_BACKENDS:
        raise ConfigError(f"unknown collective transport {kind!r}; available: {list(COLLECTIVE_BACKENDS)}")
    from bridge.transports.collective_plane import CollectiveLink

    return CollectiveLink(kind, host, port, rank, world, timeout_s)
