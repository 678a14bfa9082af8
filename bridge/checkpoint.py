"""Read a safetensors checkpoint's tensor table (names, dtypes, shapes) without loading any data, and the
``ModelSpec``: what an engine needs to start without the checkpoint's weights (its config files and that table)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from bridge.errors import ConfigError

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


TABLE_FILE = "weight_bridge_tensors.json"  # a ModelSpec's tensor table, in a directory without weights
SPEC_FILES_MAX_BYTES = 4 << 20  # the config files a spec carries: each *.json / *.txt of the checkpoint under this size


def read_tensor_table(directory: str | Path) -> dict[str, CheckpointTensor]:
    """All tensors of every ``*.safetensors`` file in ``directory``; in a directory a ``ModelSpec`` wrote
    (no weights), its ``TABLE_FILE``."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files and (directory / TABLE_FILE).exists():
        rows = json.loads((directory / TABLE_FILE).read_text())
        return {name: CheckpointTensor(name, dtype, tuple(shape)) for name, dtype, shape in rows}
    if not files:
        raise ConfigError(f"no *.safetensors files (nor a {TABLE_FILE}) in {directory}")
    table: dict[str, CheckpointTensor] = {}
    for path in files:
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            table[name] = CheckpointTensor(name, _ST_DTYPES.get(entry["dtype"], entry["dtype"]), tuple(entry["shape"]))
    return table


@dataclass(frozen=True)
class ModelSpec:
    """A model without its weights: the checkpoint's small config files (``config.json``, generation and
    tokenizer configs: every ``*.json`` / ``*.txt`` under ``SPEC_FILES_MAX_BYTES``, never ``*.safetensors``) and its
    tensor table. Enough for vLLM to build the model with ``load_format="dummy"`` and for the engine to check
    manifests; small enough to pass to an engine on any node (a Ray argument), so no node needs the checkpoint."""

    files: tuple[tuple[str, str], ...]  # (file name, text)
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape), as the checkpoint holds them

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ModelSpec:
        """The spec of a checkpoint directory: its config files and its safetensors headers (no tensor data read)."""
        directory = Path(directory)
        table = read_tensor_table(directory)
        files = tuple(sorted((p.name, p.read_text()) for p in directory.iterdir()
                             if p.is_file() and p.suffix in (".json", ".txt") and p.name != TABLE_FILE
                             and not p.name.endswith(".safetensors.index.json") and p.stat().st_size <= SPEC_FILES_MAX_BYTES))
        if not any(name == "config.json" for name, _ in files):
            raise ConfigError(f"{directory} has no config.json: a model spec needs the model's config")
        return cls(files, tuple((t.name, t.dtype, t.shape) for t in table.values()))

    def write(self, directory: str | Path) -> Path:
        """Write the config files and ``TABLE_FILE`` into ``directory`` (made if missing): a model directory
        without weights, for ``load_format="dummy"``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in self.files:
            if "/" in name or name.startswith("."):
                raise ConfigError(f"model spec file name {name!r} is not a plain file name")
            (directory / name).write_text(text)
        (directory / TABLE_FILE).write_text(json.dumps([[n, d, list(s)] for n, d, s in self.tensors]))
        return directory
