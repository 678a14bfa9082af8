"""Sync records: one per update per engine, the unit of metrics, the JSON API and the dashboard."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("pack", "transfer", "receive", "load", "finalize", "verify", "total")


@dataclass(frozen=True)
class SyncRecord:
    version: int
    engine: str
    ok: bool
    reason: str = ""
    kind: str = ""  # a failure's bridge.report.FailureKind value; empty when ok
    bytes: int = 0
    tensors: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    tensors_audited: int = 0
    stale_tensors: tuple[str, ...] = ()
    identity_violations: tuple[str, ...] = ()
    routed_sinks: int = 0
    routed_bypass: int = 0
    probe_mean_abs_logprob_diff: float | None = None
    probe_kl: float | None = None
    probe_flagged: bool = False
    noop: bool = False
    transport: str = ""  # the data plane the update's bytes came over (zmq, shm, gloo, nccl)
    adapter: str = ""  # a LoRA adapter's update: its name (``version`` is then the adapter's); empty: base weights
    # delta updates (bridge/delta.py): the version the patches applied to (0: a dense update), bytes on the wire
    # against the full tensors' bytes, tensors sent as patches and the share of their elements that changed
    delta_base: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    delta_tensors: int = 0
    density: float = 0.0
    # the same per tensor group (bridge/tensor_groups.py): group -> {wire_bytes, dense_bytes, density}
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)

    @property
    def gbps(self) -> float:
        total = self.seconds.get("total", 0.0)
        return self.bytes / total / 1e9 if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stale_tensors"] = list(self.stale_tensors)
        out["identity_violations"] = list(self.identity_violations)
        out["gbps"] = self.gbps
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncRecord:
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["stale_tensors"] = tuple(kwargs.get("stale_tensors", ()))
        kwargs["identity_violations"] = tuple(kwargs.get("identity_violations", ()))
        return cls(**kwargs)
