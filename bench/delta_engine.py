"""The delta benchmark's engine host: one engine (``bench.engine.BenchServer``: a vLLM engine, TP 1, bfloat16, the
project's receiver, baseline B in its worker) in this process, obeying JSON commands on stdin. ``bench.delta_link``
starts it inside a network namespace (``devtools/netlink.py``), the other "host" of a shaped link.

    python -m bench.delta_engine --model CKPT --config '{"transport": {"bind_host": "0.0.0.0", ...}}'

Answers (one JSON line each on stdout, prefixed ``BENCH ``): first ``{"ready": true, "port": P, "pid": ...}``;
``{"op": "baseline_b", "seed": S}`` -> ``{"seconds": ...}`` (vLLM's in-worker ``reload_weights`` from tensors already
in the worker); ``{"op": "delta", "on": false}`` -> the receiver takes patches (a fresh, empty base store) or not (no
store: it refuses patches with kind ``base``, as one configured with ``sync.delta: false``; a dense update then costs
no copy into a store); ``{"op": "status"}`` -> the engine's version and the base store's bytes; ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any


def _answer(obj: dict[str, Any]) -> None:
    print("BENCH " + json.dumps(obj), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.delta_engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", default="{}", help="the engine's weight-bridge config as JSON")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from bench.engine import BenchServer
    from inference_side.delta_base import BaseStore

    server = BenchServer(model=a.model, tensor_parallel_size=1, dtype="bfloat16", config=json.loads(a.config),
                         name="delta-bench")
    _answer({"ready": True, "port": int(server.endpoint().rsplit(":", 1)[1]), "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            try:
                if op == "baseline_b":
                    _answer({"seconds": server.baseline_b(int(cmd["seed"]))})
                elif op == "delta":
                    on = bool(cmd["on"])
                    config = dataclasses.replace(server.config, sync=dataclasses.replace(server.config.sync, delta=on))
                    server.config = server.receiver.config = config
                    if server.receiver.bases is not None:  # between syncs: its segments are closed (unlinked)
                        server.receiver.bases.clear()
                    server.receiver.bases = BaseStore() if on else None
                    _answer({"ok": True, "delta": on})
                elif op == "status":
                    bases = server.receiver.bases
                    _answer({"version": server.version(), "base_bytes": bases.nbytes if bases is not None else 0})
                else:
                    _answer({"ok": False, "error": f"unknown op {op!r}"})
            except Exception as exc:  # noqa: BLE001 - answered to bench.delta_link, which stops the run with it
                _answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
