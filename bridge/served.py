"""What an engine serves, by content: the checksum of each tensor as the updates that set it carried them.

A version number alone cannot tell a re-sent version from a different update under the same number (two
trainers sharing a version range, a trainer restarted from an older checkpoint): the engine would answer
"already served" and keep the other weights, silently. So an engine that already serves version N answers
a manifest of version N with the checksums it recorded for the manifest's tensors, and the publisher, which
packs (and sums) the buckets anyway, compares them with its own: equal, the no-op stands; different, the
update fails with VersionConflict naming the tensors, and the engine keeps serving what it served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bridge import wire
from bridge.errors import VersionConflict

SHOWN = 5  # tensor names a conflict names


@dataclass
class ServedContent:
    """Per tensor, the checksum (under ``algorithm``) of the bytes the engine last applied to it."""

    algorithm: str = ""
    sums: dict[str, int] = field(default_factory=dict)

    def record(self, algorithm: str, applied: Mapping[str, int], names: Iterable[str], scope: str = "") -> None:
        """An update that set tensors ``names`` was applied; ``applied`` holds the checksums it carried
        (none for a tensor sent without one, or when ``algorithm`` is ``none``). ``scope``: ``served_scope``
        of its manifest (a LoRA adapter's tensors are kept apart from the base's and from other adapters')."""
        if algorithm != self.algorithm:  # sums under another algorithm cannot be compared: forget them
            self.algorithm, self.sums = algorithm, {}
        if scope:  # an adapter version replaces all of the adapter's tensors: forget what it no longer has
            self.sums = {k: v for k, v in self.sums.items() if not k.startswith(scope)}
        for name in names:
            if name in applied:
                self.sums[scope + name] = applied[name]
            else:
                self.sums.pop(scope + name, None)

    def lookup(self, manifest: wire.Manifest) -> list[int] | None:
        """The recorded checksum of every tensor of ``manifest``, in its order, or None when the engine
        cannot say (another algorithm, or a tensor never updated with a checksum)."""
        if manifest.checksum in ("", "none") or manifest.checksum != self.algorithm:
            return None
        scope = served_scope(manifest)
        try:
            return [self.sums[scope + t.name] for t in manifest.tensors]
        except KeyError:
            return None


def served_scope(manifest: wire.Manifest) -> str:
    """The key prefix of a manifest's tensors in ``ServedContent``: empty for base weights; for a LoRA adapter,
    its name (adapters share PEFT tensor names, and their versions count apart from the base's)."""
    return f"adapter:{manifest.adapter.name}/" if manifest.adapter is not None else ""


def bucket_sums(specs: Sequence[wire.TensorSpec], checksums: Sequence[int]) -> dict[str, int]:
    """Tensor name -> checksum for one bucket, from its header's checksums (in the manifest's order); empty
    when the bucket was sent without them."""
    return dict(zip((s.name for s in specs), checksums, strict=True)) if len(checksums) == len(specs) else {}


def published_sums(manifest: wire.Manifest, per_bucket: Mapping[int, Sequence[int]]) -> dict[str, int]:
    """Tensor name -> checksum over every bucket of ``manifest`` (``per_bucket``: each one's checksums)."""
    out: dict[str, int] = {}
    for index, specs in enumerate(manifest.by_bucket()):
        out.update(bucket_sums(specs, per_bucket.get(index, ())))
    return out


def differing(manifest: wire.Manifest, ours: Mapping[str, int], served: Any) -> list[str] | None:
    """The tensors whose served checksum differs from ours, in manifest order; None when the comparison
    cannot be made (the engine sent no usable list, or we summed nothing)."""
    names = [t.name for t in manifest.tensors]
    if not isinstance(served, list) or len(served) != len(names) or not all(type(v) is int for v in served):
        return None
    if any(n not in ours for n in names):
        return None
    return [n for n, theirs in zip(names, served, strict=True) if ours[n] != theirs]


def conflict_reason(version: int, names: list[str], total: int) -> str:
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return (f"{VersionConflict.__name__}: version {version} is already served with different weights ({len(names)} of {total} "
            f"tensors differ: {shown}); the engine keeps serving its version {version}: publish the update under "
            f"a newer version number")
