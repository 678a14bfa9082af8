"""Exception types of weight-bridge. Every error names what was wrong."""

from __future__ import annotations

from typing import ClassVar

from bridge.report import FailureKind


class BridgeError(Exception):
    """Base class of every weight-bridge error."""

    kind: ClassVar[FailureKind] = FailureKind.OTHER


class ConfigError(BridgeError):
    """A configuration file or value is invalid."""

    kind: ClassVar[FailureKind] = FailureKind.OTHER


class WireError(BridgeError):
    """A message on the wire is malformed, truncated or of an unknown protocol."""

    kind: ClassVar[FailureKind] = FailureKind.WIRE


class ManifestError(WireError):
    """A manifest does not match the engine (unknown name, duplicate, shape, dtype, layout)."""

    kind: ClassVar[FailureKind] = FailureKind.MANIFEST


class ChecksumError(WireError):
    """A tensor's bytes do not match the checksum in the manifest."""

    kind: ClassVar[FailureKind] = FailureKind.CHECKSUM


class CorruptPatch(ChecksumError):
    """A delta's patch does not decode, or the tensor it makes does not match its declared checksum."""

    kind: ClassVar[FailureKind] = FailureKind.CHECKSUM


class NonFiniteError(WireError):
    """A tensor holds NaN or Inf and the policy rejects it."""

    kind: ClassVar[FailureKind] = FailureKind.NONFINITE


class TransportError(BridgeError):
    """A transport failed to connect, send or receive."""

    kind: ClassVar[FailureKind] = FailureKind.TRANSPORT


class DeadlineExceeded(TransportError):
    """A phase of a sync did not finish within its configured deadline."""

    kind: ClassVar[FailureKind] = FailureKind.TIMEOUT


class RankFailed(TransportError):
    """A trainer rank of a multi-rank publish died, went silent past a deadline or failed its own part of
    the update. ``rank`` names it."""

    kind: ClassVar[FailureKind] = FailureKind.TRANSPORT

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class VersionError(BridgeError):
    """A weight version is older than the one the engine serves."""

    kind: ClassVar[FailureKind] = FailureKind.VERSION


class VersionConflict(VersionError):
    """A version the engine already serves was published again with different weights."""

    kind: ClassVar[FailureKind] = FailureKind.CONFLICT


class WrongBase(BridgeError):
    """A delta names a base (version and checksum) other than the content the engine serves. Its own kind,
    not VERSION: a stale update is dropped, while a delta on the wrong base is resent dense."""

    kind: ClassVar[FailureKind] = FailureKind.BASE


class AuditError(BridgeError):
    """A tensor the trainer sent did not reach the live storage the kernels read."""

    kind: ClassVar[FailureKind] = FailureKind.STALE

    def __init__(self, message: str, tensors: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(message)
        self.tensors: tuple[str, ...] = tuple(tensors)


class IdentityError(BridgeError):
    """A parameter, buffer or backend alias changed storage during an update."""

    kind: ClassVar[FailureKind] = FailureKind.IDENTITY

    def __init__(self, message: str, violations: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(message)
        self.violations: tuple[str, ...] = tuple(violations)


class RouterError(BridgeError):
    """A tensor cannot be routed to its parameter (for example heads not divisible by TP)."""

    kind: ClassVar[FailureKind] = FailureKind.ROUTER


class UpdateFailed(BridgeError):
    """A sync failed on one or more engines. ``reasons`` maps each failing endpoint to its reason (for
    people), ``kinds`` to its FailureKind (for code)."""

    kind: ClassVar[FailureKind] = FailureKind.OTHER

    def __init__(self, message: str, reasons: dict[str, str] | None = None,
                 kinds: dict[str, FailureKind] | None = None) -> None:
        super().__init__(message)
        self.reasons: dict[str, str] = dict(reasons or {})
        self.kinds: dict[str, FailureKind] = dict(kinds or {})


class NotReady(BridgeError):
    """The engine holds no verified weights yet (started from the model's config alone, or joining its fleet):
    it refuses requests until a complete version was applied and verified."""

    kind: ClassVar[FailureKind] = FailureKind.OTHER


class FleetError(BridgeError):
    """A fleet of engines cannot do what was asked: no node can host an engine, an engine or relay did not
    start or join within its deadline, an unknown engine."""

    kind: ClassVar[FailureKind] = FailureKind.OTHER
