"""Exception types of weight-bridge. Every error names what was wrong."""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every weight-bridge error."""


class ConfigError(BridgeError):
    """A configuration file or value is invalid."""


class WireError(BridgeError):
    """A message on the wire is malformed, truncated or of an unknown protocol."""


class ManifestError(WireError):
    """A manifest does not match the engine (unknown name, duplicate, shape, dtype, layout)."""


class ChecksumError(WireError):
    """A tensor's bytes do not match the checksum in the manifest."""


class NonFiniteError(WireError):
    """A tensor holds NaN or Inf and the policy rejects it."""


class TransportError(BridgeError):
    """A transport failed to connect, send or receive."""


class DeadlineExceeded(TransportError):
    """A phase of a sync did not finish within its configured deadline."""


class VersionError(BridgeError):
    """A weight version is older than the one the engine serves."""


class VersionConflict(VersionError):
    """A version the engine already serves was published again with different weights."""


class AuditError(BridgeError):
    """A tensor the trainer sent did not reach the live storage the kernels read."""


class IdentityError(BridgeError):
    """A parameter, buffer or backend alias changed storage during an update."""


class RouterError(BridgeError):
    """A tensor cannot be routed to its parameter (for example heads not divisible by TP)."""


class UpdateFailed(BridgeError):
    """A sync failed on one or more engines. `reasons` maps each failing endpoint to its reason."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reasons: dict[str, str] = dict(reasons or {})
