"""Typed outcomes of one update, from a TP worker up to the publisher's ``PublishReport``.

A failure carries a ``FailureKind``: metrics, the dashboard, the Ray job and tests read that field; the
reason text is for people. Every hop keeps the kind it was given (worker -> engine -> receiver's ``Ack``
-> ``EngineReport`` -> ``UpdateFailed.kinds``); only the reason grows context ("rank 1: ...").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class FailureKind(StrEnum):
    """Why a sync failed on one engine. Values are the ``reason`` label of
    ``weight_bridge_sync_failures`` and the dashboard's failure class."""

    STALE = "stale"  # the write audit found a tensor whose live storage kept old values
    IDENTITY = "identity"  # a parameter, buffer or backend alias changed storage
    CHECKSUM = "checksum"  # a tensor's bytes do not match the checksum the publisher sent
    NONFINITE = "nonfinite"  # NaN or Inf under sync.nonfinite=reject
    MANIFEST = "manifest"  # a name, shape, dtype or layout the engine cannot take
    VERSION = "version"  # not newer than the served version
    CONFLICT = "conflict"  # the served version number re-used for other weights
    BASE = "base"  # a delta's base is not what the engine serves (the publisher resends dense)
    ROUTER = "router"  # a tensor cannot be routed to its parameter
    TIMEOUT = "timeout"  # a deadline passed, or a peer went silent
    WIRE = "wire"  # a malformed or out-of-order message
    TRANSPORT = "transport"  # connecting, sending or receiving failed
    ABORTED = "aborted"  # the publisher abandoned the update
    LOAD = "load"  # vLLM's load code raised inside a worker
    OTHER = "other"


def kind_of(exc: BaseException) -> FailureKind:
    """The kind of an exception: a ``BridgeError`` names its own; a few builtins map by type."""
    kind = getattr(type(exc), "kind", None)
    if isinstance(kind, FailureKind):
        return kind
    if isinstance(exc, TimeoutError):
        return FailureKind.TIMEOUT
    if isinstance(exc, ConnectionError):
        return FailureKind.TRANSPORT
    return FailureKind.OTHER


def parse_kind(value: Any) -> FailureKind | None:
    """A kind read off the wire: None for none ("" or missing), OTHER for one this side does not know."""
    if not value:
        return None
    try:
        return FailureKind(str(value))
    except ValueError:
        return FailureKind.OTHER


def describe(exc: BaseException) -> str:
    """The reason text of a failure: the exception's class and message."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class RankReport:
    """One TP worker's answer to one lifecycle call (``wb_begin`` / ``wb_load`` / ``wb_finish`` / ``wb_abort``).

    ``ok`` false carries ``kind`` and ``error``. ``held``: receive segments this worker still maps (a layer
    not yet complete keeps views of them). The audit fields are filled by ``wb_finish``."""

    rank: int
    ok: bool = True
    kind: FailureKind | None = None
    error: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    held: tuple[str, ...] = ()
    tensors: int = 0  # tensors audited
    stale: tuple[str, ...] = ()
    identity_violations: tuple[str, ...] = ()
    routed_sinks: tuple[str, ...] = ()
    routed_bypass: tuple[str, ...] = ()
    load_calls: int = 0  # model.load_weights calls (runs of tensors share one)
    runs_stopped: bool = False  # the model read ahead of a run: the rest loaded tensor by tensor
    skipped: tuple[str, ...] = ()  # tensors this rank does not hold (pipeline-missing layers)
    aliases_refreshed: int = 0  # backend copies of sinks refreshed in place

    @classmethod
    def failed(cls, rank: int, exc: BaseException, kind: FailureKind | None = None) -> RankReport:
        return cls(rank, ok=False, kind=kind or kind_of(exc), error=describe(exc))

    @classmethod
    def coerce(cls, value: RankReport | dict[str, Any]) -> RankReport:
        """A report as vLLM's ``collective_rpc`` returned it (its serializer may turn dataclasses into maps)."""
        if isinstance(value, RankReport):
            return value
        known = {k: v for k, v in value.items() if k in cls.__dataclass_fields__}
        for key in ("held", "stale", "identity_violations", "routed_sinks", "routed_bypass", "skipped"):
            known[key] = tuple(known.get(key, ()))
        known["kind"] = parse_kind(known.get("kind"))
        known["seconds"] = dict(known.get("seconds") or {})
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value if self.kind else ""
        for key in ("held", "stale", "identity_violations", "routed_sinks", "routed_bypass", "skipped"):
            out[key] = list(out[key])
        return out


def first_failure(reports: list[RankReport]) -> tuple[FailureKind, str] | None:
    """The kind of the first failing rank and every failing rank's error, joined; None when all are ok."""
    failed = [r for r in reports if not r.ok]
    if not failed:
        return None
    reason = " | ".join(f"rank {r.rank}: {r.error}" for r in failed)
    return failed[0].kind or FailureKind.OTHER, reason


@dataclass(frozen=True)
class LoadResult:
    """The engine's answer to ``load(bucket)``: empty ``error`` when loaded. ``held`` names the receive
    segments the engine still maps; the receiver reuses (or releases to the publisher) only the others."""

    error: str = ""
    kind: FailureKind | None = None
    held: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ApplyResult:
    """The engine's answer to ``finish``: the end of one update on one engine. ``report`` is what travels to
    the publisher in ``Ack.report`` (the engine's ``SyncRecord`` as a dict, plus ``ranks``)."""

    ok: bool
    reason: str = ""
    kind: FailureKind | None = None
    report: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def refused(cls, exc: BaseException, report: dict[str, Any] | None = None) -> ApplyResult:
        return cls(False, describe(exc), kind_of(exc), dict(report or {}))
