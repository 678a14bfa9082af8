"""``python -m bench.fleet``: what a fleet costs the trainer's link, and how fast an engine joins (docs/benchmarks.md).

    python -m bench.fleet [--kind 50m] [--engines-per-node 2] [--versions 3] [--out FILE]

Needs root. A 3-node Ray cluster on this host whose two worker nodes are hosts of their own
(``devtools/netns_cluster.py``: a network namespace each, joined to the head by a veth pair on a bridge, a private
``/dev/shm``, a raylet). The trainer (this process, in the root namespace) publishes through the fleet
(``apps/fleet.py``) to engines on the worker nodes only, so everything it sends crosses a node's veth: the bytes
over the trainer's link are read from the kernel's counters of the root-side veth ends (``tx_bytes``), per version.

1. **Bytes per version against nodes**: a fleet of ``--engines-per-node`` engines on one worker node publishes
   ``--versions`` versions, then the same number of engines is added on the second node and it publishes again.
   With one relay per node, the bytes per version follow the nodes, not the engines.
2. **Join against cold load**: an engine added to the fleet at the current version (vLLM's dummy load, then the
   node's relay hands it the version, verified) against an engine started from the checkpoint on disk on the
   same node (vLLM loading the safetensors): seconds from the actor's creation until it serves, in the same run.

Writes ``bench/results/<date>-fleet-<kind>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def run(kind: str, per_node: int, versions: int) -> dict[str, Any]:
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from apps.fleet import Fleet
    from bridge.checkpoint import ModelSpec
    from devtools.netns_cluster import NamespaceCluster
    from devtools.tiny_models import build_model, save_checkpoint
    from inference_side import InferenceActor

    out: dict[str, Any] = {"kind": kind, "engines_per_node": per_node, "versions": versions, "rows": []}
    extra = {"RAY_memory_monitor_refresh_ms": "0", "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with tempfile.TemporaryDirectory(prefix="wb-bench-fleet-") as tmp, \
            NamespaceCluster(2, prefix="wbbf", subnet="10.201.5.0/24", port=45150, num_cpus=2, extra_env=extra) as c:
        os.environ.update(c.env())
        reset_auth_token_state()  # Ray reads the auth mode and token once per process
        ray.init(address=c.address, namespace="wb-bench-fleet", log_to_driver=False)
        try:
            by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            w1, w2 = (by_ip[n.ip] for n in c.plan.nodes)
            veths = [n.veth_root for n in c.plan.nodes]
            model = build_model(kind, 0)
            ckpt = save_checkpoint(model, Path(tmp) / "v0")
            model_bytes = sum(p.numel() * 2 for p in model.parameters())  # bf16 on the wire
            fleet = Fleet(ModelSpec.from_checkpoint(ckpt), dtype="bfloat16", nodes=[w1, w2], namespace="wb-bench-fleet",
                          name="wbbf", start_timeout_s=900.0)
            version = 0
            try:
                fleet.add(per_node, nodes=[w1] * per_node)

                def publish_rows(nodes: int) -> None:
                    nonlocal version
                    for _ in range(versions):
                        version += 1
                        with_step = build_model(kind, version)
                        before = sum(tx_bytes(v) for v in veths)
                        t0 = time.perf_counter()
                        report = fleet.publish(with_step.named_parameters(), version=version)
                        seconds = time.perf_counter() - t0
                        sent = sum(tx_bytes(v) for v in veths) - before
                        row = {"version": version, "nodes": nodes, "engines": len(report.current),
                               "published": report.published, "link_bytes": sent, "model_bytes": model_bytes,
                               "copies": round(sent / model_bytes, 3), "seconds": round(seconds, 3)}
                        out["rows"].append(row)
                        print(json.dumps(row), flush=True)

                publish_rows(1)
                fleet.add(per_node, nodes=[w2] * per_node)
                publish_rows(2)

                # join against cold load, on the same node, at the fleet's version
                save_checkpoint(build_model(kind, version), Path(tmp) / f"v{version}")
                joins, colds = [], []
                for i in range(2):
                    t0 = time.perf_counter()
                    (name,) = fleet.add(1, nodes=[w2])
                    joins.append(time.perf_counter() - t0)
                    fleet.remove(name)
                    t0 = time.perf_counter()
                    cold = InferenceActor.options(  # type: ignore[attr-defined]
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=w2, soft=False),
                    ).remote(model=str(Path(tmp) / f"v{version}"), tensor_parallel_size=1, dtype="bfloat16")
                    ray.get(cold.generate.remote([[1, 2, 3]], max_tokens=1), timeout=900)
                    colds.append(time.perf_counter() - t0)
                    ray.get(cold.shutdown.remote(), timeout=120)
                    ray.kill(cold)
                    print(json.dumps({"try": i, "join_s": round(joins[-1], 2), "cold_load_s": round(colds[-1], 2)}),
                          flush=True)
                out["join_s"], out["cold_load_s"] = joins, colds
                out["join_over_cold"] = round(statistics.median(joins) / statistics.median(colds), 3)
            finally:
                fleet.close()
        finally:
            ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="50m", help="model preset of devtools.tiny_models (default: 50m)")
    p.add_argument("--engines-per-node", type=int, default=2)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--out", help="default: bench/results/<date>-fleet-<kind>.json")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.fleet needs root (network namespaces)", file=sys.stderr)
        return 2
    result = run(a.kind, a.engines_per_node, a.versions)
    result["load_average"] = os.getloadavg()
    path = Path(a.out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d-%H%M')}-fleet-{a.kind}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
