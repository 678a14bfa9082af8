"""The demo: a trainer process streams several weight versions into a running vLLM engine.

``make demo`` (or ``weight-bridge demo``) builds a tiny random GPT-OSS checkpoint (attention sinks and
MoE experts: the tensors stock layerwise reload leaves stale), starts a local Ray with one
``InferenceActor`` serving it, then runs ``apps.job`` as a separate process that publishes
versions 2..N+1, each with new random values for every tensor. It prints one line per sync, then
compares the engine's greedy tokens and logprobs with an engine cold-loaded from the last version.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.errors import BridgeError

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 300, 400]]
ACTOR_NAME = "engine-0"
NAMESPACE = "weight-bridge"


class DemoFailed(BridgeError):
    """A demo step did not do what it should (a sync failed or outputs differ from a cold load)."""


@dataclass(frozen=True)
class DemoArgs:
    kind: str
    syncs: int
    tp: int
    dtype: str
    transport: str | None
    config: str | None
    workdir: Path


def sync_line(report: dict[str, Any]) -> str:
    """One human line per sync, from the trainer's JSON report."""
    if "error" in report:
        return f"v{report['version']}  FAILED  {report['error']}"
    secs = report["seconds"]
    parts = [f"v{report['version']}", "ok" if report["ok"] else "FAILED",
             f"{report['bytes'] / 1e6:.1f} MB", f"{secs.get('total', 0.0):.2f} s", f"{report['gbps']:.3f} GB/s"]
    for eng in report["engines"]:
        checks = "verified" if eng["verified"] else f"NOT verified ({eng['reason']})"
        parts.append(f"[{checks}: stale {len(eng['stale'])}, storage moved {len(eng['identity'])}, "
                     f"sinks routed {eng['routed_sinks']}, bypass tensors routed {eng['routed_bypass']}]")
    return "  ".join(parts)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _run_trainer(endpoint: str, args: DemoArgs) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "apps.job", "--endpoint", endpoint, "--kind", args.kind,
           "--version", "2", "--save-dir", str(args.workdir / "versions")]
    for seed in range(2, args.syncs + 2):
        cmd += ["--seed", str(seed)]
    if args.transport:
        cmd += ["--transport", args.transport]
    if args.config:
        cmd += ["--config", args.config]
    reports = []
    log = args.workdir / "trainer.log"
    with log.open("w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                                   env=_child_env(), cwd=ROOT) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if raw.startswith("{"):
                report = json.loads(raw)
                reports.append(report)
                print(sync_line(report), flush=True)
    if proc.returncode != 0 or len(reports) != args.syncs:
        raise DemoFailed(f"trainer exited with {proc.returncode} after {len(reports)} of {args.syncs} syncs; see {log}")
    return reports


def _compare(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g["token_ids"] != w["token_ids"]:
            raise DemoFailed(f"tokens {g['token_ids']} differ from the cold-loaded engine's {w['token_ids']}")
        worst = max([worst, *(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True))])
    return worst


def run(args: DemoArgs) -> int:
    import ray
    from transformers.utils import logging as hf_logging

    from devtools.coldload import cold_outputs
    from devtools.tiny_models import make_checkpoint
    from inference_side import InferenceActor

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    v1 = make_checkpoint(args.kind, args.workdir / "v1", seed=1)
    print(f"checkpoint v1: tiny {args.kind} at {v1}", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE,
             logging_level=logging.ERROR,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        actor = InferenceActor.options(name=ACTOR_NAME).remote(  # type: ignore[attr-defined]
            model=str(v1), tensor_parallel_size=args.tp, dtype=args.dtype, config=args.config, name=ACTOR_NAME)
        endpoint = ray.get(actor.endpoint.remote(), timeout=900)
        print(f"engine {ACTOR_NAME} (vLLM, tp={args.tp}, {args.dtype}) serving v1, taking updates at {endpoint}", flush=True)
        before = ray.get(actor.generate.remote(PROMPTS, max_tokens=8, logprobs=1))
        _run_trainer(endpoint, args)
        served = ray.get(actor.version.remote())
        after = ray.get(actor.generate.remote(PROMPTS, max_tokens=8, logprobs=1))
        records = ray.get(actor.records.remote())
        (args.workdir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    finally:
        ray.shutdown()
    last = args.workdir / "versions" / f"v{served}"
    cold = cold_outputs([str(last)], args.tp, args.dtype, PROMPTS, env=_child_env())[str(last)]
    worst = _compare(after, cold)
    changed = "changed" if after != before else "UNCHANGED"
    print(f"engine serves v{served}; outputs {changed} since v1 and equal an engine cold-loaded from v{served} "
          f"(same tokens, max logprob difference {worst:.2e})", flush=True)
    print(f"{args.syncs} syncs verified in {time.perf_counter() - t0:.0f} s; records in {args.workdir / 'records.jsonl'} "
          f"(view them: weight-bridge serve --records {args.workdir / 'records.jsonl'})", flush=True)
    return 0 if after != before else 1


def parse(argv: list[str] | None) -> DemoArgs:
    p = argparse.ArgumentParser(prog="weight-bridge demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="gpt_oss", help="gpt_oss (default) or a dense preset: tiny, 50m, 350m, 1b")
    p.add_argument("--syncs", type=int, default=5, help="versions to publish (default 5)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the engine (default 1)")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype: bfloat16 (default) or float16")
    p.add_argument("--transport", help="zmq or shm (default: transport.kind of the config)")
    p.add_argument("--config", help="config YAML (default: configs/default.yaml)")
    p.add_argument("--workdir", type=Path, default=ROOT / "artifacts" / "demo", help="where checkpoints and records go")
    a = p.parse_args(argv)
    if a.syncs < 1:
        p.error("--syncs must be >= 1")
    return DemoArgs(a.kind, a.syncs, a.tp, a.dtype, a.transport, a.config, a.workdir)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    try:
        return run(parse(argv))
    except BridgeError as exc:
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
