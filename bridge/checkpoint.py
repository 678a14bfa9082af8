"""Read a safetensors checkpoint's tensor table (names, dtypes, shapes) without loading any data."""

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


def read_tensor_table(directory: str | Path) -> dict[str, CheckpointTensor]:
    """All tensors of every ``*.safetensors`` file in ``directory``."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {directory}")
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
