"""A trainer process: builds (or loads) a policy, changes its weights, publishes versions.

``python -m trainer_side.job --endpoint tcp://127.0.0.1:PORT --kind tiny --seed 2 --version 2``
prints one JSON line per published version. Used by the demo, the tests and the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.config import load_config
from bridge.errors import BridgeError
from bridge.tiny_models import build_model, save_checkpoint
from trainer_side.publisher import PublishReport, WeightPublisher


@dataclass(frozen=True)
class TrainerArgs:
    endpoints: tuple[str, ...]
    kind: str
    seeds: tuple[int, ...]
    first_version: int
    save_dir: str | None
    config: str | None
    transport: str | None


def report_line(report: PublishReport) -> dict[str, Any]:
    return {
        "version": report.version,
        "ok": report.ok,
        "bytes": report.bytes,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "engines": [{"endpoint": e.endpoint, "ok": e.ok, "verified": e.verified, "reason": e.reason, "noop": e.noop,
                     "stale": e.engine.get("stale_tensors", []), "identity": e.engine.get("identity_violations", []),
                     "routed_sinks": e.engine.get("routed_sinks", 0), "routed_bypass": e.engine.get("routed_bypass", 0)}
                    for e in report.engines],
    }


def run(args: TrainerArgs) -> int:
    config = load_config(args.config)
    status = 0
    with WeightPublisher(list(args.endpoints), config=config, transport=args.transport) as pub:
        for i, seed in enumerate(args.seeds):
            version = args.first_version + i
            model = build_model(args.kind, seed)
            if args.save_dir:
                save_checkpoint(model, Path(args.save_dir) / f"v{version}")
            try:
                line = report_line(pub.publish(model.named_parameters(), version=version))
            except BridgeError as exc:
                line = {"version": version, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                status = 1
            print(json.dumps(line), flush=True)
    return status


def parse(argv: list[str] | None = None) -> TrainerArgs:
    p = argparse.ArgumentParser(prog="trainer_side.job", description=__doc__)
    p.add_argument("--endpoint", action="append", required=True, help="inference endpoint (repeat for several)")
    p.add_argument("--kind", default="tiny", help="gpt_oss or a dense preset: tiny, 50m, 350m, 1b")
    p.add_argument("--seed", type=int, action="append", required=True, help="one seed per version to publish")
    p.add_argument("--version", type=int, default=1, help="version of the first publish")
    p.add_argument("--save-dir", help="also save each published version as a checkpoint here")
    p.add_argument("--config", help="config YAML (default: configs/default.yaml)")
    p.add_argument("--transport", help="zmq or shm (default: from config)")
    a = p.parse_args(argv)
    return TrainerArgs(tuple(a.endpoint), a.kind, tuple(a.seed), a.version, a.save_dir, a.config, a.transport)


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
