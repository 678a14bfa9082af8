"""``python -m bench.grpo_density``: how much of the model the GRPO example's real steps change, per sync (docs/benchmarks.md).

    python -m bench.grpo_density [--steps 30] [--lrs 3e-3,1e-4,1e-5] [--out FILE]
    python -m bench.grpo_density --logs run.jsonl ...   # summarize logs of ``examples/grpo_toy.py`` already run

Runs ``examples/grpo_toy.py --steps N --lr X`` (one local engine, ``sync.delta`` on, the default config) once per
learning rate and reads each step's sync record: whether the publish went as a delta or dense (and why), its
bytes on the wire against dense, and the share of elements whose bf16 bit pattern changed (``density``, exact for
a delta; for an update the publisher sent dense because over half changed, its estimate on one element in 61,
parsed from the reason). Writes ``bench/results/<date>-delta-grpo.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ESTIMATE = re.compile(r"about ([0-9.]+)% of the elements changed")


def step_row(line: dict[str, Any]) -> dict[str, Any]:
    """One step's delta telemetry from the example's JSON line."""
    d = line["sync"].get("delta") or {}
    density = d.get("density")
    estimated = None
    if density is None and (found := ESTIMATE.search(d.get("why", ""))):
        estimated = float(found.group(1)) / 100
    return {"step": line["step"], "reward": line["reward"], "mode": d.get("mode", "dense"), "why": d.get("why", ""),
            "wire_bytes": d.get("wire_bytes"), "dense_bytes": d.get("dense_bytes"), "ratio": d.get("ratio"),
            "density": density, "density_estimated": estimated, "sync_seconds": line["seconds"]["sync"],
            "ok": bool(line["sync"].get("ok") and line["sync"].get("verified"))}


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step rows and their medians over the steps after the first (which has no base and goes dense)."""
    steps = [step_row(x) for x in lines if "step" in x]
    later = steps[1:]
    changed = [s["density"] if s["density"] is not None else s["density_estimated"] for s in later]
    changed = [c for c in changed if c is not None]
    summary: dict[str, Any] = next((x["summary"] for x in lines if "summary" in x), {})
    return {"steps": steps, "summary": summary,
            "delta_steps": sum(s["mode"] == "delta" for s in later), "later_steps": len(later),
            "median_changed": statistics.median(changed) if changed else None,
            "range_changed": [min(changed), max(changed)] if changed else None,
            "median_wire_ratio": statistics.median(s["ratio"] for s in later) if later else None,
            "range_wire_ratio": [min(s["ratio"] for s in later), max(s["ratio"] for s in later)] if later else None,
            "every_sync_ok": all(s["ok"] for s in steps)}


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]


def run(steps: int, lr: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "examples/grpo_toy.py", "--steps", str(steps), "--lr", lr]
    meta: dict[str, Any] = {"command": "python " + " ".join(cmd[1:]), "load_average_start": os.getloadavg()}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    meta.update(rc=done.returncode, load_average_end=os.getloadavg())
    if done.returncode != 0:
        raise RuntimeError(f"{meta['command']} failed (rc {done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")], meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.grpo_density", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lrs", default="3e-3,1e-4,1e-5", help="Adam learning rates (the example's default: 3e-3)")
    p.add_argument("--logs", nargs="*", default=None, help="summarize these JSON-lines logs instead of running")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    started = time.time()
    runs = []
    if a.logs:
        for log in a.logs:
            runs.append({"log": log, **summarize(read_log(Path(log)))})
    else:
        for lr in a.lrs.split(","):
            lines, meta = run(a.steps, lr)
            runs.append({"lr": float(lr), **meta, **summarize(lines)})
    for r in runs:
        print(f"{r.get('lr', r.get('log'))}: {r['delta_steps']}/{r['later_steps']} later steps as deltas; changed elements median "
              f"{r['median_changed']}, range {r['range_changed']}; wire / dense median {r['median_wire_ratio']}, "
              f"range {r['range_wire_ratio']}; reward {r['summary']}")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d-%H%M', time.gmtime(started))}-delta-grpo.json"
    out.write_text(json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "runs": runs}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
