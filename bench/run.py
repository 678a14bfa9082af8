"""``python -m bench.run [--quick] [--models 50m,350m,1b] [--reps N]``: the benchmark (method and goals: docs/benchmarks.md).

For each synthetic model it starts one engine and one trainer process and measures, in the same run:
``bridge`` per transport and sync mode (end to end: tensors in the trainer process -> every engine's
verified ack), ``baseline_a`` (save_pretrained + ``reload_weights(weights_path)``), ``baseline_b`` (vLLM's
in-process ``reload_weights`` from tensors already in the worker; one run after each sync, so each row's B
is measured in the same minute as its syncs), ``limit`` (bytes / torch copy bandwidth measured now) and,
on the smallest model, 1/2/4 receivers, and ``vllm_serve``: the same model behind ``vllm serve`` with the
``weight_bridge`` backend, driven by vLLM's ``HTTPVLLMWeightSyncClient`` + ``WeightBridgeTrainerEngine`` from the
trainer process, its syncs alternating with the InferenceActor's over the same transport and mode, and ``lora``:
on an engine started with LoRA enabled, a LoRA adapter's sync (the adapter alone, ``publish(..., adapter=)``)
against a full sync of the same model and against merge-then-full-sync (the adapter merged into the base
weights in the trainer, then every weight sent), in alternating rounds. Medians; ratios are the verdict.
Writes ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.memory import peak_growth, reset_peaks
from bench.report import (
    add_ratios,
    lora_ratios,
    lora_table,
    lora_verdict,
    serve_ratios,
    serve_table,
    serve_verdict,
    table,
    verdict,
)
from bridge import wire
from bridge.report import ApplyResult, LoadResult
from inference_side.contract import EngineGate, Restore, StagedBucket

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CHECKPOINT_SEED = 1
ENGINE_BYTES = 3 << 30  # one more tp1 engine of the smallest model: actor + engine core + worker + 1 GiB KV cache


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]
    transports: tuple[str, ...]
    modes: tuple[str, ...]
    reps: int
    receivers: tuple[int, ...]
    bucket_mb: float
    out: Path
    sweep_mb: tuple[float, ...] = ()
    vllm_serve: bool = True
    serve_port: int = 0  # vllm serve's HTTP port, its receivers on the ports after it; 0: free ports
    lora: bool = True
    lora_rank: int = 8
    lora_only: bool = False  # the LoRA rows alone (no baselines, transports, receivers or vllm serve rows)


# the adapter rows: over these transports (cross-host and same-host), staged; vLLM's LoRA settings of the engine
LORA_TRANSPORTS = ("zmq", "shm")
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}

# the transports the weight_bridge backend's worker-side receivers are reached over; not ipc: the trainer engine
# addresses tcp://host:base_port+rank, and a worker's ipc:// endpoint (a private directory made when its receiver
# starts) reaches no trainer through vLLM's init call, which returns nothing
SERVE_TRANSPORTS = ("zmq", "shm", "gloo")


def parse(argv: list[str] | None) -> Plan:
    p = argparse.ArgumentParser(prog="bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 50m model only, 3 repetitions, receivers 1 and 2")
    p.add_argument("--models", default="50m,350m,1b", help="comma-separated presets of devtools.tiny_models")
    p.add_argument("--transports", default="zmq,ipc,shm,gloo", help="zmq (tcp://), ipc (ZMQ on ipc://), shm, gloo")
    p.add_argument("--modes", default="staged,streaming")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--receivers", default="1,2,4", help="receiver counts measured on the smallest model")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--sweep-mb", default="", help="also measure the fastest transport/mode at these bucket sizes (MB, comma-separated)")
    p.add_argument("--no-vllm-serve", action="store_true", help="skip the rows for the weight_bridge backend behind vllm serve")
    p.add_argument("--serve-port", type=int, default=0,
                   help="vllm serve's HTTP port; its receivers take the ports after it (default: free ports)")
    p.add_argument("--no-lora", action="store_true",
                   help="skip the LoRA adapter rows (adapter sync against full sync and merge-then-sync)")
    p.add_argument("--lora-only", action="store_true", help="only the LoRA rows (each model: its LoRA engine alone)")
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the adapter in the LoRA rows (at most 8: the engine's max_lora_rank)")
    p.add_argument("--out", default=str(RESULTS / "latest.json"))
    a = p.parse_args(argv)
    if a.lora_only and a.no_lora:
        p.error("--lora-only and --no-lora exclude each other")
    if not 1 <= a.lora_rank <= LORA_ENGINE["max_lora_rank"]:
        p.error(f"--lora-rank must be from 1 to {LORA_ENGINE['max_lora_rank']} (the LoRA engine's max_lora_rank)")
    models = ("50m",) if a.quick else tuple(a.models.split(","))
    reps = 3 if a.quick else a.reps
    receivers = (1, 2) if a.quick and a.receivers == "1,2,4" else tuple(int(x) for x in a.receivers.split(","))
    sweep = tuple(float(x) for x in a.sweep_mb.split(",") if x)
    return Plan(models, tuple(a.transports.split(",")), tuple(a.modes.split(",")), reps, receivers, a.bucket_mb, Path(a.out), sweep,
                vllm_serve=not a.no_vllm_serve, serve_port=a.serve_port, lora=not a.no_lora, lora_rank=a.lora_rank,
                lora_only=a.lora_only)


# ---- the trainer process ------------------------------------------------------------------------

class Trainer:
    def __init__(self, kind: str, seed: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.trainer", "--kind", kind, "--seed", str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.bytes = int(self._read()["bytes"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("BENCH "):
                return dict(json.loads(line[6:]))
        raise RuntimeError(f"bench trainer exited (rc={self.proc.wait()})")

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (RuntimeError, BrokenPipeError):
                pass
            self.proc.wait(30)


# ---- measurements -------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes per second of a torch copy of ``nbytes`` (capped at 512 MiB) in this process."""
    import torch

    n = min(nbytes, 512 << 20)
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


class Engines:
    def __init__(self, ckpt: Path, count: int) -> None:
        import ray

        from bench.engine import bench_actor

        self.actors = [bench_actor().remote(model=str(ckpt), tensor_parallel_size=1, dtype="bfloat16") for _ in range(count)]
        self.endpoints = [ray.get(a.endpoint.remote(), timeout=900) for a in self.actors]
        self.ipc_endpoints = [ray.get(a.endpoint.remote("ipc")) for a in self.actors]
        self.pids = [p for a in self.actors for p in ray.get(a.pids.remote())]

    def add(self, ckpt: Path, count: int) -> None:
        import ray

        from bench.engine import bench_actor

        new = [bench_actor().remote(model=str(ckpt), tensor_parallel_size=1, dtype="bfloat16") for _ in range(count)]
        self.endpoints += [ray.get(a.endpoint.remote(), timeout=900) for a in new]
        self.ipc_endpoints += [ray.get(a.endpoint.remote("ipc")) for a in new]
        self.pids += [p for a in new for p in ray.get(a.pids.remote())]
        self.actors += new

    def set_mode(self, mode: str, bucket_mb: float) -> None:
        import ray

        ray.get([a.set_config.remote(_config(mode, bucket_mb)) for a in self.actors])

    def close(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=60)
            finally:
                ray.kill(a)


def _config(mode: str, bucket_mb: float) -> dict[str, Any]:
    return {"sync": {"mode": mode}, "transport": {"bucket_mb": bucket_mb}}


class Versions:
    def __init__(self) -> None:
        self.v = 1

    def next(self) -> int:
        self.v += 1
        return self.v


def measure_bridge(trainer: Trainer, engines: Engines, transport: str, mode: str, plan: Plan, versions: Versions,
                   count: int | None = None, bucket_mb: float | None = None, paired: bool = False) -> dict[str, Any]:
    """Median seconds of ``plan.reps`` syncs after a warm-up. ``paired``: one baseline B run on the first
    engine right after each sync, so the row's ``baseline_b`` comes from the same minute as its bridge
    times (this machine's speed drifts over the minutes a model takes) and each sync has its own ratio."""
    import ray

    # "ipc" is the ZMQ data plane on the engines' ipc:// endpoints; the others connect over tcp://
    endpoints = (engines.ipc_endpoints if transport == "ipc" else engines.endpoints)[: count or len(engines.endpoints)]
    transport = "zmq" if transport == "ipc" else transport
    pids = engines.pids if count is None or count == len(engines.endpoints) else []
    bucket_mb = bucket_mb or plan.bucket_mb
    engines.set_mode(mode, bucket_mb)
    config = _config(mode, bucket_mb)
    warm = trainer.ask(op="publish", endpoints=endpoints, transport=transport, version=versions.next(), config=config)
    if not warm.get("ok"):
        raise RuntimeError(f"bridge {transport}/{mode} failed: {warm}")
    totals, phases, peaks, b, held = [], [], [], [], []
    for i in range(plan.reps):
        before = reset_peaks(pids) if pids else {}
        rep = trainer.ask(op="publish", endpoints=endpoints, transport=transport, version=versions.next(), config=config)
        if not rep.get("ok") or not all(e["verified"] for e in rep["engines"]):
            raise RuntimeError(f"bridge {transport}/{mode} failed or unverified: {rep}")
        if before:
            peaks.append(peak_growth(before))
        totals.append(rep["seconds"]["total"])
        held.append(int(rep.get("held_bytes", 0)))
        if paired:
            b.append(float(ray.get(engines.actors[0].baseline_b.remote(200 + i))))
        phases.append({**rep["seconds"], **{k: max(e.get(k, 0.0) for e in rep["engine_seconds"])
                                             for k in rep["engine_seconds"][0] if k.startswith("engine_")}})
    keys = sorted({k for p in phases for k in p})
    out = {
        "bridge": statistics.median(totals),
        "bridge_all": totals,
        "phases": {k: statistics.median([p.get(k, 0.0) for p in phases]) for k in keys},
        "peak_rss_growth_bytes": max(peaks) if peaks else None,
        "publisher_held_bytes": max(held),  # packing buffers kept between syncs (shm: in /dev/shm)
    }
    if b:
        out.update(baseline_b=statistics.median(b), baseline_b_all=b, paired_ratios=[t / x for t, x in zip(totals, b, strict=True)])
    return out


def measure_serve(trainer: Trainer, engines: Engines, serve: Any, transport: str, mode: str, plan: Plan,
                  versions: Versions, base_port: int) -> dict[str, Any]:
    """The backend behind ``vllm serve`` against the InferenceActor, same transport and mode: after a warm-up
    of each, ``plan.reps`` rounds of one InferenceActor sync and one ``send_weights()`` to vllm serve (the order
    alternating), so both are measured in the same minute. Each sync must come back verified; at the end
    ``/weight_info`` must name the last version."""
    from bench.serve import serve_config

    engines.set_mode(mode, plan.bucket_mb)
    config = _config(mode, plan.bucket_mb)
    sconfig = serve_config(transport, mode, plan.bucket_mb)

    def actor() -> dict[str, Any]:
        rep = trainer.ask(op="publish", endpoints=engines.endpoints, transport=transport, version=versions.next(), config=config)
        if not rep.get("ok") or not all(e["verified"] for e in rep["engines"]):
            raise RuntimeError(f"bridge {transport}/{mode} failed or unverified: {rep}")
        return rep

    def vllm() -> dict[str, Any]:
        rep = trainer.ask(op="vllm", url=serve.url, base_port=base_port, config=sconfig, version=versions.next())
        if not rep.get("ok") or not all(e["verified"] for e in rep["engines"]):
            raise RuntimeError(f"vllm serve {transport}/{mode} failed or unverified: {rep}")
        return rep

    actor()
    vllm()
    a: list[dict[str, Any]] = []
    v: list[dict[str, Any]] = []
    for i in range(plan.reps):
        if i % 2:
            v.append(vllm())
            a.append(actor())
        else:
            a.append(actor())
            v.append(vllm())
    served = serve.weight_version()
    if served != str(v[-1]["version"]):
        raise RuntimeError(f"vllm serve {transport}/{mode}: /weight_info names {served}, the last sync was {v[-1]['version']}")
    actor_s = [r["seconds"]["total"] for r in a]
    publish = [r["seconds"]["total"] for r in v]
    whole = [float(r["send_weights"]) for r in v]
    phases: dict[str, list[float]] = {}
    for r in v:
        for k, x in [*r["seconds"].items(), *((f"http_{k}", x) for k, x in r["http"].items())]:
            phases.setdefault(k, []).append(float(x))
        phases.setdefault("outside_publish", []).append(float(r["send_weights"]) - r["seconds"]["total"])
    return {"actor": statistics.median(actor_s), "actor_all": actor_s, "publish": statistics.median(publish), "publish_all": publish,
            "send_weights": statistics.median(whole), "send_weights_all": whole,
            "paired_publish": [x / y for x, y in zip(publish, actor_s, strict=True)],
            "paired_send_weights": [x / y for x, y in zip(whole, actor_s, strict=True)],
            "actor_phases": {k: statistics.median([r["seconds"].get(k, 0.0) for r in a]) for k in a[0]["seconds"]},
            "phases": {k: statistics.median(x) for k, x in phases.items()}, "weight_info": served}


def serve_rows(trainer: Trainer, engines: Engines, ckpt: Path, kind: str, rows: list[dict[str, Any]], plan: Plan,
               workdir: Path, versions: Versions) -> list[dict[str, Any]]:
    """One ``vllm serve`` process for this model, measured over every transport of ``SERVE_TRANSPORTS`` in the plan
    and every mode; each row also carries the InferenceActor row of that transport/mode measured before."""
    from bench.serve import ServeProcess, free_port

    transports = [t for t in plan.transports if t in SERVE_TRANSPORTS]
    need = ENGINE_BYTES + 2 * trainer.bytes  # the engine with its weights, and the serve publisher's segments
    if not transports:
        return []
    if available_memory() < need + (2 << 30):
        why = f"not enough memory for a vllm serve engine ({available_memory() / (1 << 30):.1f} GiB available)"
        logger.warning("%s: skipping the vllm serve rows: %s", kind, why)
        return [{"model": kind, "vllm_serve": True, "skipped": why}]
    t0 = time.perf_counter()
    serve = ServeProcess(ckpt, workdir / f"{kind}-vllm-serve.log", port=plan.serve_port)
    logger.info("%s: vllm serve up at %s in %.0fs", kind, serve.url, time.perf_counter() - t0)
    out = []
    try:
        for i, (transport, mode) in enumerate((t, m) for t in transports for m in plan.modes):
            base_port = plan.serve_port + 1 + i if plan.serve_port else free_port()
            logger.info("%s: vllm serve over %s (%s), receivers at %d", kind, transport, mode, base_port)
            m = measure_serve(trainer, engines, serve, transport, mode, plan, versions, base_port)
            row = next((r for r in rows if r["receivers"] == 1 and not r.get("sweep") and not r.get("fanout")
                        and (r["transport"], r["mode"]) == (transport, mode)), None)
            out.append({"model": kind, "transport": transport, "mode": mode, "receivers": 1, "bytes": trainer.bytes,
                        "bucket_mb": plan.bucket_mb, "vllm_serve": True, "actor_row": row["bridge"] if row else None, **m})
    finally:
        try:
            trainer.ask(op="vllm_close")
        except (RuntimeError, BrokenPipeError):  # the trainer process died: the error in flight says why
            pass
        finally:
            serve.close()
    return out


def measure_lora(trainer: Trainer, endpoints: list[str], transport: str, plan: Plan, versions: Versions,
                 adapter_versions: Versions) -> dict[str, Any]:
    """An adapter sync, a full sync and a merge-then-full-sync to the same LoRA-enabled engine (staged), after a
    warm-up of each: ``plan.reps`` rounds of one of each, the order rotating, so all three are measured in the
    same minute. Each must come back verified."""
    config = _config("staged", plan.bucket_mb)
    hows = ("adapter", "full", "merged")

    def sync(how: str) -> dict[str, Any]:
        version = adapter_versions.next() if how == "adapter" else versions.next()
        rep = trainer.ask(op="lora", how=how, endpoints=endpoints, transport=transport, version=version, config=config)
        if not rep.get("ok") or not all(e["verified"] for e in rep["engines"]):
            raise RuntimeError(f"lora rows: {how} sync over {transport} failed or unverified: {rep}")
        return rep

    for how in hows:
        sync(how)
    got: dict[str, list[dict[str, Any]]] = {how: [] for how in hows}
    for i in range(plan.reps):
        for how in hows[i % 3:] + hows[:i % 3]:
            got[how].append(sync(how))
    out: dict[str, Any] = {}
    for how, reps in got.items():
        totals = [r["seconds"]["total"] for r in reps]
        out[how] = statistics.median(totals)
        out[f"{how}_all"] = totals
        out[f"{how}_bytes"] = reps[-1]["bytes"]
        out[f"{how}_phases"] = {k: statistics.median([r["seconds"].get(k, 0.0) for r in reps]) for k in reps[0]["seconds"]}
    out["merge"] = out["merged_phases"].get("merge", 0.0)
    out["paired_full_over_adapter"] = [f / a for f, a in zip(out["full_all"], out["adapter_all"], strict=True)]
    out["paired_merged_over_adapter"] = [m / a for m, a in zip(out["merged_all"], out["adapter_all"], strict=True)]
    return out


def lora_rows(trainer: Trainer, ckpt: Path, kind: str, plan: Plan, versions: Versions) -> list[dict[str, Any]]:
    """One engine started with LoRA enabled (``LORA_ENGINE``) for this model; per transport of ``LORA_TRANSPORTS``
    in the plan, the adapter sync against a full sync and merge-then-sync (``measure_lora``). At the end the
    engine must serve the last adapter version."""
    import ray

    from apps.lora import DEFAULT_TARGETS
    from bench.engine import bench_actor

    transports = [t for t in plan.transports if t in LORA_TRANSPORTS]
    if not transports:
        return []
    if available_memory() < ENGINE_BYTES + 2 * trainer.bytes + (2 << 30):
        why = f"not enough memory for a LoRA engine ({available_memory() / (1 << 30):.1f} GiB available)"
        logger.warning("%s: skipping the LoRA rows: %s", kind, why)
        return [{"model": kind, "lora": True, "skipped": why}]
    init = trainer.ask(op="lora_init", rank=plan.lora_rank, targets=list(DEFAULT_TARGETS))
    actor = bench_actor().remote(model=str(ckpt), tensor_parallel_size=1, dtype="bfloat16", **LORA_ENGINE)
    out = []
    try:
        endpoints = [str(ray.get(actor.endpoint.remote(), timeout=900))]
        adapter_versions = Versions()
        for transport in transports:
            logger.info("%s: LoRA rows over %s", kind, transport)
            m = measure_lora(trainer, endpoints, transport, plan, versions, adapter_versions)
            out.append({"model": kind, "transport": transport, "mode": "staged", "lora": True, "rank": plan.lora_rank,
                        "targets": list(DEFAULT_TARGETS), "adapter_param_bytes": init["adapter_bytes"],
                        "bytes": trainer.bytes, "bucket_mb": plan.bucket_mb, **m})
        served = ray.get(actor.adapter_version.remote("bench"))
        if served != adapter_versions.v:
            raise RuntimeError(f"lora rows: the engine serves adapter version {served}, the last sync was {adapter_versions.v}")
    finally:
        try:
            trainer.ask(op="lora_close")
        except (RuntimeError, BrokenPipeError):  # the trainer process died: the error in flight says why
            pass
        try:
            ray.get(actor.shutdown.remote(), timeout=60)
        finally:
            ray.kill(actor)
    return out


def measure_relay(trainer: Trainer, engines: Engines, mode: str, plan: Plan, versions: Versions) -> dict[str, Any]:
    """Fan-out across hosts as a relay does it: the trainer sends each update once, over tcp://, to a relay
    (in this process) in front of every engine; the relay forwards it to their ipc:// endpoints over shm."""
    from inference_side.relay import Relay

    engines.set_mode(mode, plan.bucket_mb)
    config = _config(mode, plan.bucket_mb)
    relay = Relay(engines.ipc_endpoints, config, name="bench-relay")
    try:
        totals = []
        for i in range(plan.reps + 1):
            rep = trainer.ask(op="publish", endpoints=[relay.endpoint()], transport="zmq", version=versions.next(), config=config)
            if not rep.get("ok") or not all(e["verified"] for e in rep["engines"]):
                raise RuntimeError(f"relay {mode} failed or unverified: {rep}")
            if i:  # the first one warms the relay's staging
                totals.append(rep["seconds"]["total"])
        return {"bridge": statistics.median(totals), "bridge_all": totals, "phases": {}, "peak_rss_growth_bytes": None}
    finally:
        relay.shutdown()


class NullGate(EngineGate):
    """A receiver with no engine behind it: stages and verifies every bucket, applies nothing. Publishing
    to it measures the transport alone."""

    def info(self) -> wire.EngineInfo:
        from bridge.transports import available

        return wire.EngineInfo(dtype="bfloat16", version=0, tp_size=1, transports=tuple(t for t in available() if t != "nccl"), host="bench")

    def validate(self, manifest: wire.Manifest) -> str | None:
        return None

    def begin(self, manifest: wire.Manifest, restore: Restore | None = None) -> None:
        pass

    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        return LoadResult()

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        return ApplyResult(True)

    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        pass


RAW = {"checksum": "none", "verify_checksums": False, "nonfinite": "allow"}


def measure_transport_alone(trainer: Trainer, transport: str, plan: Plan, versions: Versions, raw: bool = False,
                            count: int = 1) -> float:
    """Median seconds to move the model (already in bfloat16) into ``count`` receivers in this process that
    stage every bucket but have no engine: the data plane alone, checksums and finiteness included, or with
    ``raw`` neither (``sync.checksum: none``, ``verify_checksums: false``, ``nonfinite: allow``)."""
    from bridge.config import config_from_dict
    from inference_side.receiver import SyncReceiver

    config = _config("staged", plan.bucket_mb)
    if raw:
        config["sync"] = {**config["sync"], **RAW}
    receivers = [SyncReceiver(NullGate(), config_from_dict(config)) for _ in range(count)]
    try:
        for receiver in receivers:
            receiver.start()
        endpoints = [r.ipc_endpoint if transport == "ipc" else r.endpoint for r in receivers]
        wire_transport = "zmq" if transport == "ipc" else transport
        totals = []
        for i in range(plan.reps + 1):
            rep = trainer.ask(op="publish", endpoints=endpoints, transport=wire_transport, version=versions.next(),
                              config=config, precast="bfloat16")
            if not rep.get("ok"):
                raise RuntimeError(f"{transport} alone failed: {rep}")
            if i:
                totals.append(rep["seconds"]["total"])
        return statistics.median(totals)
    finally:
        for receiver in receivers:
            receiver.stop()


def concurrent_baseline_b(actors: list[Any], plan: Plan) -> float:
    """Baseline B started on every engine at once: the median over repetitions of the slowest engine's
    reload seconds. The floor for a fan-out to all of them on this machine (their reloads share its cores
    however the bytes arrive)."""
    import ray

    slowest = []
    for i in range(plan.reps + 1):
        seconds = ray.get([a.baseline_b.remote(300 + i) for a in actors])
        if i:
            slowest.append(max(float(s) for s in seconds))
    return statistics.median(slowest)


def measure_baselines(trainer: Trainer, engines: Engines, plan: Plan, workdir: Path, versions: Versions) -> dict[str, Any]:
    import ray

    actor = engines.actors[0]
    a_totals, a_save, a_reload = [], [], []
    for i in range(plan.reps + 1):
        target = workdir / f"baseline-a-{versions.next()}"
        save = float(trainer.ask(op="save", dir=str(target))["seconds"])
        reload = float(ray.get(actor.baseline_a_reload.remote(str(target))))
        if i:  # the first round warms the page cache and the loader
            a_totals.append(save + reload)
            a_save.append(save)
            a_reload.append(reload)
    b = [float(ray.get(actor.baseline_b.remote(100 + i))) for i in range(plan.reps + 1)][1:]
    return {"baseline_a": statistics.median(a_totals), "baseline_a_save": statistics.median(a_save),
            "baseline_a_reload": statistics.median(a_reload), "baseline_b": statistics.median(b),
            "baseline_b_block": statistics.median(b), "baseline_a_all": a_totals, "baseline_b_all": b}


def run_model(kind: str, plan: Plan, workdir: Path, scaling: bool) -> list[dict[str, Any]]:
    from devtools.tiny_models import make_checkpoint

    t0 = time.perf_counter()
    ckpt = make_checkpoint(kind, workdir / f"{kind}-ckpt", CHECKPOINT_SEED)
    trainer = Trainer(kind, seed=7)
    if plan.lora_only:
        try:
            return lora_rows(trainer, ckpt, kind, plan, Versions())
        finally:
            trainer.close()
            logger.info("%s done in %.0fs", kind, time.perf_counter() - t0)
    engines = Engines(ckpt, 1)
    rows: list[dict[str, Any]] = []
    skipped: list[int] = []
    versions = Versions()
    try:
        bw = copy_bandwidth(trainer.bytes)
        limit = trainer.bytes / bw
        base = measure_baselines(trainer, engines, plan, workdir, versions)
        for transport in plan.transports:
            alone = measure_transport_alone(trainer, transport, plan, versions)
            alone_raw = measure_transport_alone(trainer, transport, plan, versions, raw=True)
            for mode in plan.modes:
                logger.info("%s: bridge over %s (%s)", kind, transport, mode)
                m = measure_bridge(trainer, engines, transport, mode, plan, versions, paired=True)
                rows.append({"model": kind, "transport": transport, "mode": mode, "receivers": 1, "bytes": trainer.bytes,
                             "limit": limit, "copy_gbps": bw / 1e9, "bucket_mb": plan.bucket_mb, "transport_alone": alone,
                             "transport_alone_raw": alone_raw,
                             **base, **m})
        fastest = min(rows, key=lambda r: r["bridge"])
        if plan.vllm_serve:
            rows += serve_rows(trainer, engines, ckpt, kind, rows, plan, workdir, versions)
        if plan.lora:
            rows += lora_rows(trainer, ckpt, kind, plan, versions)
        actor_rows = [r for r in rows if not r.get("vllm_serve") and not r.get("lora")]
        for mb in plan.sweep_mb:
            if mb == plan.bucket_mb:
                continue
            m = measure_bridge(trainer, engines, fastest["transport"], fastest["mode"], plan, versions, bucket_mb=mb)
            rows.append({**fastest, **m, "bucket_mb": mb, "sweep": True})
        if scaling:
            best = min((r for r in actor_rows if r["receivers"] == 1 and not r.get("sweep")), key=lambda r: r["bridge"])
            for count in plan.receivers:
                if count <= 1:
                    continue
                need = (count - len(engines.actors)) * ENGINE_BYTES
                if available_memory() < need + (2 << 30):
                    logger.warning("skipping %d receivers: %.1f GiB available, about %.1f GiB needed",
                                   count, available_memory() / (1 << 30), need / (1 << 30))
                    skipped.append(count)
                    continue
                engines.add(ckpt, count - len(engines.actors))
                best.setdefault("baseline_b_concurrent", concurrent_baseline_b(engines.actors[:1], plan))
                m = measure_bridge(trainer, engines, best["transport"], best["mode"], plan, versions)
                m["baseline_b_concurrent"] = concurrent_baseline_b(engines.actors, plan)
                # the same fan-out with no engines behind the receivers: what the transport itself costs
                alone = measure_transport_alone(trainer, best["transport"], plan, versions, count=count)
                common = {"model": kind, "mode": best["mode"], "receivers": count, "bytes": trainer.bytes, "limit": limit,
                          "copy_gbps": bw / 1e9, "bucket_mb": plan.bucket_mb, **base}
                rows.append({**common, "transport": best["transport"], "transport_alone": alone, **m})
                # across hosts: one tcp:// stream per engine, against one stream to a host-local relay
                direct = measure_bridge(trainer, engines, "zmq", best["mode"], plan, versions)
                rows.append({**common, "transport": "zmq", "fanout": True, **direct})
                rows.append({**common, "transport": "relay", "fanout": True, **measure_relay(trainer, engines, best["mode"], plan, versions)})
    finally:
        trainer.close()
        engines.close()
    logger.info("%s done in %.0fs", kind, time.perf_counter() - t0)
    for count in skipped:
        rows.append({"model": kind, "receivers": count, "skipped": "not enough memory for the extra engines"})
    return rows


# ---- report -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = parse(argv)
    import ray

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}})
    rows: list[dict[str, Any]] = []
    started = time.time()
    load_at_start = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="wb-bench-") as tmp:
            smallest = plan.models[0]
            for kind in plan.models:
                rows += run_model(kind, plan, Path(tmp), scaling=kind == smallest and len(plan.receivers) > 1)
    finally:
        ray.shutdown()
    skipped_rows = [r for r in rows if "skipped" in r]
    served = [serve_ratios(r) for r in rows if r.get("vllm_serve") and "skipped" not in r]
    lora = [lora_ratios(r) for r in rows if r.get("lora") and "skipped" not in r]
    rows = [add_ratios(r) for r in rows if "skipped" not in r and not r.get("vllm_serve") and not r.get("lora")]
    if rows:
        print(table(rows))
    if served:
        print(serve_table(served))
    if lora:
        print(lora_table(lora))
    for r in skipped_rows:
        what = "vllm serve rows" if r.get("vllm_serve") else "LoRA rows" if r.get("lora") else f"{r['receivers']} receivers"
        print(f"{r['model']}: {what} skipped: {r['skipped']}")
    for line in verdict(rows) + serve_verdict(served) + lora_verdict(lora):
        print(line)
    by_model: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["receivers"] == 1 and not r.get("sweep"):
            by_model.setdefault(r["model"], {})[f"{r['transport']}/{r['mode']}"] = {
                k: r.get(k) for k in ("bridge", "baseline_a", "baseline_b", "limit", "receivers", "bytes", "transport_alone", "transport_alone_raw")}
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "seconds": time.time() - started,
              "host": platform.node(), "cpus": os.cpu_count(), "reps": plan.reps, "bucket_mb": plan.bucket_mb,
              "models": by_model, "rows": rows, "vllm_serve": served, "lora": lora, "skipped": skipped_rows,
              "verdict": verdict(rows) + serve_verdict(served) + lora_verdict(lora),
              "load_average_start": load_at_start, "load_average": os.getloadavg()}
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {plan.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
