"""Transports: each owns both ends of a data plane behind one small base (base.py), loaded lazily by name.

Control messages (hello, manifest, credits, acks, heartbeats) always travel over ZMQ; the transport
decides how bucket bytes travel: as ZMQ frames (``zmq``), written once into same-host shared memory
(``shm``), or over a private gloo/NCCL group (``gloo``, ``nccl``; torch.distributed is imported only when
such a plane is made). The transport names are written here and nowhere else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bridge.errors import ConfigError

if TYPE_CHECKING:
    from bridge.config import BridgeConfig
    from bridge.transports.base import LandPlane, SendPlane

COLLECTIVE = ("gloo", "nccl")  # bytes travel over a link the publisher offers before the manifest

# name -> (sending end, receiving end), each ``module:Class``
_TRANSPORTS: dict[str, tuple[str, str]] = {
    "zmq": ("bridge.transports.zmq_plane:ZmqSendPlane", "bridge.transports.zmq_plane:ZmqLandPlane"),
    "shm": ("bridge.transports.shm_plane:ShmSendPlane", "bridge.transports.shm_plane:ShmLandPlane"),
    "gloo": ("bridge.transports.collective_plane:GlooSendPlane", "bridge.transports.collective_inbox:GlooLandPlane"),
    "nccl": ("bridge.transports.collective_plane:NcclSendPlane", "bridge.transports.collective_inbox:NcclLandPlane"),
}


def register_transport(kind: str, send: str, land: str) -> None:
    """Register a transport by its two ends, each ``module:Class`` (imported on first use)."""
    _TRANSPORTS[kind] = (send, land)


def available() -> list[str]:
    return sorted(_TRANSPORTS)


def _load(kind: str, end: int) -> Any:
    try:
        target = _TRANSPORTS[kind][end]
    except KeyError as exc:
        raise ConfigError(f"unknown transport {kind!r}; available: {available()}") from exc
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def send_plane(kind: str, config: BridgeConfig) -> SendPlane:
    """A new sending end of ``kind`` for a publisher with ``config``."""
    plane: SendPlane = _load(kind, 0).from_config(config)
    return plane


def land_plane(kind: str, config: BridgeConfig) -> LandPlane:
    """A new receiving end of ``kind`` for a receiver with ``config``."""
    plane: LandPlane = _load(kind, 1)(config)
    return plane


def collective_link(kind: str, host: str, port: int, rank: int, world: int, timeout_s: float = 60.0) -> Any:
    """A collective data-plane link (``gloo`` or ``nccl``, see collective_plane.py); torch.distributed
    is imported only here, so nothing on the ZMQ/shm path ever loads it."""
    if kind not in COLLECTIVE:
        raise ConfigError(f"unknown collective transport {kind!r}; available: {list(COLLECTIVE)}")
    from bridge.transports.collective_plane import CollectiveLink

    return CollectiveLink(kind, host, port, rank, world, timeout_s)
