"""LoRA adapters as versions: what an engine admits of an adapter update, and the PEFT directory it serves.

An adapter update is a manifest with an ``AdapterSpec`` (bridge/wire.py): its tensors are the adapter's,
named as PEFT saves them (``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``), checked here
against the engine's LoRA configuration (rank within ``max_lora_rank``, target modules the model has, each
module's A ``[r, in]`` and B ``[out, r]`` against the base weight ``[out, in]``) instead of against the
checkpoint's tensors. Once every bucket arrived verified, the engine writes the tensors and the config into a
fresh PEFT directory (``adapter_model.safetensors`` + ``adapter_config.json``) and registers it with vLLM under a
new LoRA id; the previous version's id serves until then. Behind ``vllm serve`` (the ``weight_bridge`` backend) the
worker that verified it writes the directory with a marker (``MARKER``) last, and the server's adapter route
(inference_side/vllm_adapters.py) serves only a directory whose marker names the version asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge import wire
from bridge.errors import ManifestError, VersionError

PEFT_PREFIX = "base_model.model."
_PART = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_A|lora_B)\.weight$")
_PLAIN_TARGET = re.compile(r"^[A-Za-z0-9_]+$")
# what this door takes of a PEFT config; other features are refused with their name
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "modules_to_save": "modules_to_save",
                "layer_replication": "layer_replication", "rank_pattern": "rank_pattern",
                "alpha_pattern": "alpha_pattern", "use_qalora": "QALoRA", "alora_invocation_tokens": "aLoRA"}
_NOT_TARGETS = ("embed_tokens", "lm_head")
MARKER = "weight_bridge_adapter.json"  # written last into a PEFT directory whose adapter version was verified


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter version vLLM serves: its LoRA id and PEFT directory."""

    name: str
    version: int
    lora_id: int
    path: str
    rank: int
    targets: tuple[str, ...]
    checksum: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "lora_id": self.lora_id, "rank": self.rank, "targets": list(self.targets),
                "path": self.path}


def linear_modules(table: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Module path -> base weight shape ``[out, in]`` of every 2-D ``.weight`` a LoRA may target."""
    out = {}
    for name, entry in table.items():
        if name.endswith(".weight") and len(entry.shape) == 2:
            module = name.removesuffix(".weight")
            if module.rsplit(".", 1)[-1] not in _NOT_TARGETS:
                out[module] = tuple(entry.shape)
    return out


def validate_adapter(manifest: wire.Manifest, table: Mapping[str, Any], max_rank: int | None,
                     served: int | None) -> str | None:
    """Raise ``VersionError`` for an adapter version older than the one ``served`` (None: none served yet),
    return a no-op reason for that version itself, raise ``ManifestError`` naming what the engine cannot take
    (LoRA not enabled, rank above ``max_rank``, an unknown target module, a tensor name or shape that does
    not fit, an unsupported PEFT feature). None: the update can be taken."""
    adapter = manifest.adapter
    assert adapter is not None
    name = adapter.name
    if max_rank is None:
        raise ManifestError(f"adapter {name}: this engine was started without LoRA (enable_lora=True, max_lora_rank ...)")
    if served is not None:
        if manifest.version < served:
            raise VersionError(f"adapter {name}: version {manifest.version} is older than the served version {served}")
        if manifest.version == served:
            return f"adapter {name} version {manifest.version} already served"
    config = adapter.config
    for key, feature in _UNSUPPORTED.items():
        if config.get(key):
            raise ManifestError(f"adapter {name}: {feature} ({key}) is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise ManifestError(f"adapter {name}: bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("peft_type", "LORA") != "LORA":
        raise ManifestError(f"adapter {name}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = adapter.rank
    if rank > max_rank:
        raise ManifestError(f"adapter {name}: rank r={rank} is larger than the engine's max_lora_rank {max_rank}")
    modules = linear_modules(table)
    have = sorted({m.rsplit(".", 1)[-1] for m in modules})
    targets = adapter.target_modules
    for target in targets:
        if not _PLAIN_TARGET.fullmatch(target):
            raise ManifestError(f"adapter {name}: target module {target!r} is not a module name (patterns are not supported)")
        if target not in have:
            raise ManifestError(f"adapter {name}: unknown target module {target!r}: the model has no such linear layer "
                                f"(it has {', '.join(have)})")
    if not manifest.tensors:
        raise ManifestError(f"adapter {name}: the update carries no tensors")
    parts: dict[str, set[str]] = {}
    for spec in manifest.tensors:
        match = _PART.fullmatch(spec.name.removeprefix(PEFT_PREFIX)) if spec.name.startswith(PEFT_PREFIX) else None
        if match is None:
            raise ManifestError(f"adapter {name}: tensor {spec.name!r} is not a PEFT LoRA weight "
                                f"({PEFT_PREFIX}<module>.lora_A.weight or .lora_B.weight)")
        module, ab = match["module"], match["ab"]
        base = modules.get(module)
        if base is None:
            raise ManifestError(f"adapter {name}: tensor {spec.name}: the model has no linear layer {module!r}")
        if module.rsplit(".", 1)[-1] not in targets:
            raise ManifestError(f"adapter {name}: tensor {spec.name}: module {module!r} is not among the target "
                                f"modules {list(targets)}")
        want = (rank, base[1]) if ab == "lora_A" else (base[0], rank)
        if spec.shape != want:
            raise ManifestError(f"adapter {name}: tensor {spec.name}: shape {list(spec.shape)} does not match "
                                f"{list(want)} (rank {rank}, base weight {list(base)})")
        if spec.dtype not in wire.FLOAT_DTYPES or spec.dtype.startswith("float8"):
            raise ManifestError(f"adapter {name}: tensor {spec.name}: dtype {spec.dtype} is not a LoRA weight dtype")
        parts.setdefault(module, set()).add(ab)
    half = sorted(m for m, ab in parts.items() if len(ab) != 2)
    if half:
        raise ManifestError(f"adapter {name}: module {half[0]!r} has only {next(iter(parts[half[0]]))} "
                            f"(a LoRA module needs lora_A and lora_B)")
    return None


def write_peft_dir(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, Any]) -> Path:
    """An adapter directory as PEFT saves one: ``adapter_model.safetensors`` and ``adapter_config.json``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=False)
    save_file(dict(tensors), str(directory / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "bias": "none", **dict(config)}
    (directory / "adapter_config.json").write_text(json.dumps(body, indent=2, sort_keys=True))
    return directory


def bucket_tensors(buffer: memoryview, specs: list[wire.TensorSpec]) -> dict[str, Any]:
    """Copies (CPU torch tensors) of a verified bucket's tensors: the bucket's memory is reused after the update."""
    import torch

    out = {}
    for spec in specs:
        raw = bytearray(buffer[spec.offset: spec.offset + spec.nbytes])
        out[spec.name] = torch.frombuffer(raw, dtype=getattr(torch, spec.dtype)).reshape(spec.shape)
    return out


def write_marker(directory: Path, name: str, version: int, rank: int, targets: tuple[str, ...]) -> None:
    """Mark ``directory`` (complete: tensors and config written) as adapter ``name`` version ``version``,
    verified; written to a temporary name and renamed, so a reader sees all of it or none."""
    body = {"name": name, "version": version, "rank": rank, "target_modules": list(targets)}
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps(body, sort_keys=True))
    tmp.replace(directory / MARKER)


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of a verified adapter directory (None: none, or not readable as one)."""
    try:
        body = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def check_activation(marker: Mapping[str, Any] | None, path: str, name: str, version: int, served: int | None) -> str | None:
    """Whether the adapter route may serve ``path`` as adapter ``name`` version ``version`` while ``served``
    (None: none) is the version it serves now. Raises ``ManifestError`` when the directory is not that version
    as the engine verified it (no marker, or a marker naming another adapter or version), ``VersionError`` for
    a version older than the served one; returns a no-op reason for the served version itself; None: serve it."""
    if marker is None:
        raise ManifestError(f"adapter {name}: {path} is not an adapter directory the weight_bridge backend verified "
                            f"(no readable {MARKER})")
    if marker.get("name") != name or marker.get("version") != version:
        raise ManifestError(f"adapter {name}: {path} holds adapter {marker.get('name')!r} version "
                            f"{marker.get('version')!r}, not {name!r} version {version}")
    if served is not None:
        if version < served:
            raise VersionError(f"adapter {name}: version {version} is older than the served version {served}")
        if version == served:
            return f"adapter {name} version {version} already served"
    return None
