"""A trainer process: builds (or loads) a policy, changes its weights, publishes versions.

``python -m apps.job --endpoint tcp://127.0.0.1:PORT --kind tiny --seed 2 --version 2``
prints one JSON line per published version. Used by the demo, the tests and the benchmark.
Each version carries the parity probe (the trainer's float32 log-probabilities of fixed sequences,
``trainer_side/probe.py``) unless ``--no-probe``; each engine's line then reports the mismatch.
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
from devtools.tiny_models import build_model, save_checkpoint
from trainer_side.probe import build_probe
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
    probe: bool = True


def report_line(report: PublishReport) -> dict[str, Any]:
    return {
        "version": report.version,
        "ok": report.ok,
        "bytes": report.bytes,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "held_bytes": report.held_bytes,
        "engines": [{"endpoint": e.endpoint, "ok": e.ok, "verified": e.verified, "reason": e.reason, "noop": e.noop,
                     "stale": e.engine.get("stale_tensors", []), "identity": e.engine.get("identity_violations", []),
                     "routed_sinks": e.engine.get("routed_sinks", 0), "routed_bypass": e.engine.get("routed_bypass", 0),
                     "probe_mean_abs_logprob_diff": e.engine.get("probe_mean_abs_logprob_diff"),
                     "probe_kl": e.engine.get("probe_kl"), "probe_flagged": bool(e.engine.get("probe_flagged"))}
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
                probe = build_probe(model) if args.probe else None
                line = report_line(pub.publish(model.named_parameters(), version=version, probe=probe))
            except BridgeError as exc:
                line = {"version": version, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                status = 1
            print(json.dumps(line), flush=True)
    return status


def parse(argv: list[str] | None = None) -> TrainerArgs:
    p = argparse.ArgumentParser(prog="apps.job", description=__doc__)
    p.add_argument("--endpoint", action="append", required=True, help="inference endpoint (repeat for several)")
    p.add_argument("--kind", default="tiny", help="gpt_oss or a dense preset: tiny, 50m, 350m, 1b")
    p.add_argument("--seed", type=int, action="append", required=True, help="one seed per version to publish")
    p.add_argument("--version", type=int, default=1, help="version of the first publish")
    p.add_argument("--save-dir", help="also save each published version as a checkpoint here")
    p.add_argument("--config", help="config YAML (default: configs/default.yaml)")
    p.add_argument("--transport", help="zmq, shm, gloo or nccl (default: from config)")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="send the parity probe (trainer's float32 logprobs of fixed sequences) with each version")
    a = p.parse_args(argv)
    return TrainerArgs(tuple(a.endpoint), a.kind, tuple(a.seed), a.version, a.save_dir, a.config, a.transport,
                       a.probe)


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
