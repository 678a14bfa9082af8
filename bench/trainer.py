"""The benchmark's trainer process: builds one synthetic model once, then obeys JSON commands on stdin.

Commands (one JSON object per line; one JSON answer per line on stdout, prefixed ``BENCH ``):
``{"op": "publish", "endpoints": [...], "transport": "shm", "version": 7, "config": {...}}`` -> the
publish report (its ``seconds.total`` runs from tensors in this process to every engine's verified ack;
with ``"precast": "bfloat16"`` the tensors are already in the wire dtype, so only the transport works);
``{"op": "save", "dir": D}`` -> seconds of ``save_pretrained`` (baseline A's first half);
``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from apps.job import report_line
from bridge.config import config_from_dict
from bridge.errors import BridgeError
from devtools.tiny_models import build_model, save_checkpoint
from trainer_side.publisher import WeightPublisher


def _answer(obj: dict[str, Any]) -> None:
    print("BENCH " + json.dumps(obj), flush=True)


def serve(kind: str, seed: int) -> int:
    model = build_model(kind, seed)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    publishers: dict[str, WeightPublisher] = {}
    precast: dict[str, list[tuple[str, Any]]] = {}
    _answer({"ready": True, "bytes": sum(t.numel() * t.element_size() for _, t in named)})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "save":
            t0 = time.perf_counter()
            save_checkpoint(model, cmd["dir"])
            _answer({"seconds": time.perf_counter() - t0})
        elif op == "publish":
            key = json.dumps([cmd["endpoints"], cmd["transport"], cmd.get("config", {})], sort_keys=True)
            pub = publishers.get(key)
            if pub is None:
                for old in publishers.values():
                    old.close()
                publishers.clear()
                pub = publishers[key] = WeightPublisher(cmd["endpoints"], config=config_from_dict(cmd.get("config", {})),
                                                        transport=cmd["transport"])
            weights = named
            if cmd.get("precast"):
                import torch

                dtype = cmd["precast"]
                weights = precast.setdefault(dtype, [(n, t.to(getattr(torch, dtype))) for n, t in named])
            try:
                report = pub.publish(weights, version=int(cmd["version"]))
                _answer({**report_line(report), "engine_seconds": [e.seconds for e in report.engines]})
            except BridgeError as exc:
                _answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        else:
            _answer({"ok": False, "error": f"unknown op {op!r}"})
    for pub in publishers.values():
        pub.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.trainer", description=__doc__)
    p.add_argument("--kind", required=True)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    return serve(a.kind, a.seed)


if __name__ == "__main__":
    sys.exit(main())
