"""A receiver process without a model: ``python -m tests.recording_receiver CONFIG_JSON [PORT]`` starts a
SyncReceiver (on PORT, default any free one), prints ``ENDPOINT <tcp://...>`` and serves until its stdin
closes, then prints what reached its engine (``stop`` returns it). The engine behind it is a
``FakeEngine(keep="crc32")`` (tests/fakes.py): it reads every tensor's bytes from the staged buckets and
reports their crc32 in the ack (``report["crc32"]``), so a test can compare what each receiver got with
what the trainer sent."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.helpers import ROOT


def start(config: dict[str, Any], count: int = 1, port: int = 0) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """``count`` receiver processes of this module with ``config`` (the first on ``port`` if given), and their
    endpoints; ``stop`` ends them."""
    procs = [subprocess.Popen([sys.executable, "-m", "tests.recording_receiver", json.dumps(config), str(port if i == 0 else 0)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(count)]
    endpoints = []
    for p in procs:
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ENDPOINT "):
            stop(procs)
            raise RuntimeError(f"a recording receiver did not start: {line!r}")
        endpoints.append(line.split()[1])
    return procs, endpoints


def stop(procs: list[subprocess.Popen[str]]) -> list[dict[str, list[int]]]:
    """End the processes and return, per process, the versions that reached its engine's ``validate`` and
    those it applied (``{"validated": [...], "applied": [...]}``); raises if the receiver in one of them broke
    the engine contract."""
    broken = []
    seen = []
    for p in procs:
        out, _ = p.communicate(timeout=30)  # closing stdin stops it
        broken += [line for line in out.splitlines() if line.startswith("VIOLATION ")]
        seen += [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("SEEN ")]
    assert not broken, f"a receiver broke the engine contract: {broken}"
    return seen


def main(config_json: str, port: int = 0) -> None:
    from bridge.config import config_from_dict
    from inference_side.receiver import SyncReceiver
    from tests.fakes import FakeEngine

    engine = FakeEngine(keep="crc32")
    receiver = SyncReceiver(engine, config_from_dict(json.loads(config_json)), port=port)
    print(f"ENDPOINT {receiver.start()}", flush=True)
    sys.stdin.read()
    receiver.stop()
    for violation in engine.violations:
        print(f"VIOLATION {violation}", flush=True)
    print(f"SEEN {json.dumps({'validated': engine.validated, 'applied': engine.applied})}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
