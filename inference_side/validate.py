"""What an engine admits: the version rules and the manifest checked against the engine's checkpoint."""

from __future__ import annotations

from typing import Any

from bridge import wire
from bridge.errors import ManifestError, VersionError


def validate_manifest(manifest: wire.Manifest, table: dict[str, Any], dtype: str, served: int,
                      degraded: str | None = None) -> str | None:
    """Raise ``VersionError`` for a version older than ``served``; return a no-op reason for ``served`` itself
    (unless the engine is degraded: then a complete copy of it is welcome); raise ``ManifestError`` for a
    tensor the engine's checkpoint ``table`` lacks or holds with another shape or dtype (floats travel in the
    engine's ``dtype``). None: the update can be taken."""
    if manifest.adapter is not None:  # an engine with LoRA enabled checks adapters with lora.validate_adapter
        raise ManifestError(f"adapter {manifest.adapter.name}: this engine takes no LoRA adapter updates (start it "
                            f"with LoRA enabled: enable_lora=True, or vllm serve --enable-lora)")
    if manifest.version < served:
        raise VersionError(f"version {manifest.version} is older than the served version {served}")
    if manifest.version == served and not degraded:
        return f"version {manifest.version} already served"
    for spec in manifest.tensors:
        entry = table.get(spec.name)
        if entry is None:
            raise ManifestError(f"unknown tensor name {spec.name!r}: the engine's checkpoint has no such tensor")
        if spec.shape != entry.shape:
            raise ManifestError(f"tensor {spec.name}: shape {list(spec.shape)} does not match the engine's {list(entry.shape)}")
        want = dtype if entry.dtype in wire.FLOAT_DTYPES else entry.dtype
        if spec.dtype != want:
            raise ManifestError(f"tensor {spec.name}: dtype {spec.dtype} does not match the engine's {want}")
    return None
