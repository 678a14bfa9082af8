"""A receiver process without a model: ``python tests/recording_receiver.py CONFIG_JSON`` starts a
SyncReceiver, prints ``ENDPOINT <tcp://...>`` and serves until its stdin closes. Its gate applies an
update by reading every tensor's bytes from the staged buckets and reports their crc32 in the ack
(``report["crc32"]``), so a test can compare what each receiver got with what the trainer sent."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

from bridge import wire


class CrcGate:
    def __init__(self) -> None:
        self.version = 0

    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype="bfloat16", version=self.version, tp_size=1, transports=("zmq", "shm"), host="test")

    def validate(self, manifest: wire.Manifest) -> str | None:
        return None

    def apply(self, manifest: wire.Manifest, buckets: list[Any], timings: dict[str, float]) -> Any:
        from inference_side.receiver import ApplyResult

        crc = {s.name: zlib.crc32(b.segment.buffer[s.offset : s.offset + s.nbytes]) for b in buckets for s in b.specs}
        self.version = manifest.version
        return ApplyResult(True, "", {"crc32": crc, "seconds": dict(timings)})


def start(config: dict[str, Any], count: int = 1) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """``count`` receiver processes of this module with ``config``, and their endpoints; ``stop`` ends them."""
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "tests/recording_receiver.py", json.dumps(config)], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    endpoints = []
    for p in procs:
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ENDPOINT "):
            stop(procs)
            raise RuntimeError(f"a recording receiver did not start: {line!r}")
        endpoints.append(line.split()[1])
    return procs, endpoints


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.communicate(timeout=30)  # closing stdin stops it


def main(config_json: str) -> None:
    from bridge.config import config_from_dict
    from inference_side.receiver import SyncReceiver

    receiver = SyncReceiver(CrcGate(), config_from_dict(json.loads(config_json)))
    print(f"ENDPOINT {receiver.start()}", flush=True)
    sys.stdin.read()
    receiver.stop()


if __name__ == "__main__":
    main(sys.argv[1])
