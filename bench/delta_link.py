"""``python -m bench.delta_link``: delta updates against dense updates and baseline B, on loopback ``tcp://`` and over
shaped links between two network namespaces (method and results: docs/benchmarks.md, "Delta updates").

    python -m bench.delta_link [--models 50m,350m] [--densities 0.001,0.01,0.05,0.3,1] [--paths loopback,10gbit,1gbit]
                               [--reps 3] [--mode staged]

Needs root (``ip netns``, ``ip link``, ``tc``). Per model, one engine (``bench/delta_engine.py``: a real vLLM engine,
TP 1, bfloat16, the project's receiver, baseline B in its worker) runs in the namespace ``wbbench-delta``, joined
to the root namespace by a veth pair shaped on both ends with ``tc qdisc ... tbf rate R burst 256kb latency 50ms``
(``devtools/netlink.py``; the link is removed at the end, on an error and on Ctrl-C/SIGTERM too). Its receiver
binds 0.0.0.0 with ``transport.allow_unauthenticated: true`` (plain ZMQ, no CURVE: a trusted link). Paths:

- ``loopback``: the trainer process (``bench/trainer.py``) in the same namespace, over ``tcp://127.0.0.1``;
- ``shm`` (not in the default list): the same, the buckets in shared memory (``transport.kind: shm``; control over
  ``tcp://127.0.0.1``);
- ``10gbit``, ``1gbit``: the trainer process in the root namespace, over ``tcp://10.200.<i>.2`` through the veth pair.

Each version is the previous one with a share (the density) of every tensor's bf16 elements scaled by
1 + 0.01·N(0, 1) (``rl_step_``, as ``bench/delta_codec.py``). Per path and density, in the same minute: a block of
``--reps`` delta syncs (publisher and receiver ``sync.delta: true``; after an untimed warm-up sync that gives both
the base) and a block of ``--reps`` dense syncs (``sync.delta: false`` on both sides), each sync followed by one
baseline B on the engine (vLLM's in-worker ``reload_weights`` from tensors already there). Every sync must come
back applied and verified. Medians; the ratios are the verdict. Writes ``bench/results/<date>-delta-<models>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.run import Versions

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DENSITIES = (0.001, 0.01, 0.05, 0.3, 1.0)
PATHS = ("loopback", "10gbit", "1gbit")
NAMESPACE = "wbbench-delta"
CHECKPOINT_SEED = 1


def rl_step_(tensors: list[Any], density: float, seed: int, scale: float = 1e-2) -> None:
    """The next RL-like version, in place: in every tensor, ``density`` of its elements (sampled with replacement
    up to 5%, which repeats under 2.5% of them; each element with that probability at 30%; all at 1) scaled by
    1 + ``scale``·N(0, 1), computed in float32 and cast back (bf16 rounding leaves about 22% of them unchanged)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            if not t.is_floating_point() or t.numel() == 0:
                continue
            flat = t.view(-1)
            n = flat.numel()
            if density >= 1.0:
                flat.copy_((flat.float() * (1 + scale * torch.randn(n, generator=gen))).to(flat.dtype))
                continue
            if density > 0.05:
                idx = (torch.rand(n, generator=gen) < density).nonzero().view(-1)
            else:
                idx = torch.randint(n, (max(1, round(n * density)),), generator=gen)
            flat[idx] = (flat[idx].float() * (1 + scale * torch.randn(idx.numel(), generator=gen))).to(flat.dtype)


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]
    densities: tuple[float, ...]
    paths: tuple[str, ...]
    reps: int
    mode: str
    bucket_mb: float
    link_index: int
    out: Path | None
    trainer_cores: str = ""  # taskset's list for the trainer process ("": unbound)


def parse(argv: list[str] | None) -> Plan:
    p = argparse.ArgumentParser(prog="bench.delta_link", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="50m,350m", help="comma-separated presets of devtools.tiny_models")
    p.add_argument("--densities", default=",".join(f"{d:g}" for d in DENSITIES))
    p.add_argument("--paths", default=",".join(PATHS), help="loopback and/or tc rates (e.g. 1gbit, 10gbit)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--mode", default="staged", choices=("staged", "streaming"))
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--link-index", type=int, default=210, help="the link's subnet: 10.200.<index>.0/24")
    p.add_argument("--out", default=None, help="default: bench/results/<date>-delta-<models>.json")
    p.add_argument("--trainer-cores", default="", help="run the trainer under taskset -c CORES (a trainer on cores of "
                   "its own, as on another host; vLLM binds its TP 1 worker to core 0 here); default: unbound")
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error("--reps must be at least 1")
    densities = tuple(float(x) for x in a.densities.split(","))
    if not all(0.0 < d <= 1.0 for d in densities):
        p.error("densities must be in (0, 1]")
    return Plan(tuple(a.models.split(",")), densities, tuple(a.paths.split(",")), a.reps, a.mode, a.bucket_mb,
                a.link_index, Path(a.out) if a.out else None, a.trainer_cores)


class Child:
    """A bench process obeying JSON commands on stdin and answering ``BENCH {...}`` lines on stdout."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], what: str, timeout_s: float = 900) -> None:
        self.what = what
        self.log = log
        self._logf = log.open("w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._logf, text=True,
                                     env=env, cwd=ROOT, start_new_session=True)
        self.first = self.read(timeout_s)

    def read(self, timeout_s: float = 900) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s

        def expired(signum: int, frame: object) -> None:
            raise TimeoutError(f"{self.what}: no answer within {timeout_s:.0f}s (log: {self.log})")

        old = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1.0))
        try:
            for line in self.proc.stdout:
                if line.startswith("BENCH "):
                    return dict(json.loads(line[6:]))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        raise RuntimeError(f"{self.what} exited (rc={self.proc.wait()}); log: {self.log}")

    def ask(self, timeout_s: float = 900, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def close(self) -> None:
        """``quit``, then SIGTERM and SIGKILL to this child's own process group (its vLLM engine core included)."""
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        self.proc.wait(30)
        self._logf.close()


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


def _config(plan: Plan, delta: bool) -> dict[str, Any]:
    return {"sync": {"mode": plan.mode, "delta": delta}, "transport": {"bucket_mb": plan.bucket_mb}}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure_block(trainer: Child, engine: Child, endpoint: str, plan: Plan, density: float, delta: bool,
                  versions: Versions, seeds: Versions, transport: str = "zmq") -> dict[str, Any]:
    """An untimed warm-up sync, then ``plan.reps`` of (next version at ``density``, a sync, baseline B)."""
    answer = engine.ask(op="delta", on=delta)
    if not answer.get("ok"):
        raise RuntimeError(f"engine: {answer}")
    config = _config(plan, delta)
    syncs, b, reports = [], [], []
    for i in range(plan.reps + 1):
        trainer.ask(op="step", density=density, seed=seeds.next())
        rep = trainer.ask(op="publish", endpoints=[endpoint], transport=transport, version=versions.next(), config=config,
                          timeout_s=600)
        if not rep.get("ok") or not all(e["ok"] and e["verified"] for e in rep["engines"]):
            raise RuntimeError(f"{'delta' if delta else 'dense'} sync at density {density:g} failed or unverified: {rep}")
        if i == 0:  # the warm-up: connects, and gives the publisher and the receiver the base
            continue
        syncs.append(float(rep["seconds"]["total"]))
        reports.append(rep)
        got = engine.ask(op="baseline_b", seed=1000 + seeds.next())
        if "seconds" not in got:
            raise RuntimeError(f"baseline B failed: {got}")
        b.append(float(got["seconds"]))
    status = engine.ask(op="status")  # the receiver's base store now (empty with deltas off)
    d = [r.get("delta") or {} for r in reports]
    phases = sorted({k for r in reports for k in r["seconds"]})
    return {
        "seconds": statistics.median(syncs), "seconds_all": syncs, "baseline_b": statistics.median(b), "baseline_b_all": b,
        "paired_over_b": [s / x for s, x in zip(syncs, b, strict=True)],
        "modes": [x.get("mode", "dense") for x in d], "why": [x.get("why", "") for x in d if x.get("why")],
        "wire_bytes": statistics.median(int(x.get("wire_bytes", r["bytes"])) for x, r in zip(d, reports, strict=True)),
        "dense_bytes": int(reports[0]["bytes"]),
        "density": [x.get("density") for x in d],
        "phases": {k: statistics.median(float(r["seconds"].get(k, 0.0)) for r in reports) for k in phases},
        # the engine's own phases (its receiver: landing, verification, rebuild, load), slowest engine
        "engine_phases": {k: statistics.median(max(float(e.get(k, 0.0)) for e in r["engine_seconds"]) for r in reports)
                          for k in sorted({k for r in reports for e in r["engine_seconds"] for k in e})},
        "publisher_base_bytes": max(int(r.get("base_bytes", 0)) for r in reports),
        "receiver_base_bytes": int(status.get("base_bytes", 0)),
    }


def measure_path(trainer: Child, engine: Child, endpoint: str, kind: str, path: str, plan: Plan, versions: Versions,
                 seeds: Versions, rows: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """Every density on this path; each row is appended to ``rows`` and ``save``d as soon as it is measured."""
    for density in plan.densities:
        load = _load()
        t0 = time.time()
        transport = "shm" if path == "shm" else "zmq"
        dlt = measure_block(trainer, engine, endpoint, plan, density, True, versions, seeds, transport)
        dense = measure_block(trainer, engine, endpoint, plan, density, False, versions, seeds, transport)
        row = {"model": kind, "path": path, "density": density, "mode": plan.mode, "load_average_start": load,
               "load_average_end": _load(), "started": time.strftime("%H:%M:%S", time.gmtime(t0)),
               "delta": dlt, "dense": dense,
               "wire_over_dense": dlt["wire_bytes"] / dlt["dense_bytes"],
               "delta_over_dense": dlt["seconds"] / dense["seconds"],
               "dense_over_delta": dense["seconds"] / dlt["seconds"],
               "delta_over_b": dlt["seconds"] / statistics.median(dlt["baseline_b_all"] + dense["baseline_b_all"]),
               "dense_over_b": dense["seconds"] / statistics.median(dlt["baseline_b_all"] + dense["baseline_b_all"]),
               "delta_over_b_paired": statistics.median(dlt["paired_over_b"]),
               "dense_over_b_paired": statistics.median(dense["paired_over_b"])}
        logger.info("%s %s %g: wire %.2f%% of dense, delta %.3fs, dense %.3fs, B %.3fs (load %s)", kind, path, density,
                    100 * row["wire_over_dense"], dlt["seconds"], dense["seconds"], dlt["baseline_b"], load)
        rows.append(row)
        save()


def run_model(kind: str, plan: Plan, workdir: Path, versions: Versions, seeds: Versions, rows: list[dict[str, Any]],
              save: Callable[[], None]) -> None:
    from devtools.netlink import Link, exec_in, reshape, shaped_link
    from devtools.tiny_models import make_checkpoint

    ckpt = make_checkpoint(kind, workdir / f"{kind}-ckpt", CHECKPOINT_SEED)
    rates = [p for p in plan.paths if p not in ("loopback", "shm")]
    link = Link(NAMESPACE, index=plan.link_index, rate=rates[0] if rates else "10gbit")
    with shaped_link(link):
        engine_config = {"transport": {"bind_host": "0.0.0.0", "allow_unauthenticated": True, "bucket_mb": plan.bucket_mb},
                         "sync": {"mode": plan.mode, "delta": True}}
        t0 = time.perf_counter()
        engine = Child(exec_in(link, [sys.executable, "-m", "bench.delta_engine", "--model", str(ckpt),
                                      "--config", json.dumps(engine_config)]),
                       workdir / f"{kind}-engine.log", _env(VLLM_HOST_IP=link.ns_addr), f"{kind} engine")
        try:
            port = int(engine.first["port"])
            logger.info("%s: engine up in namespace %s, port %d, in %.0fs", kind, link.name, port, time.perf_counter() - t0)
            bound = ["taskset", "-c", plan.trainer_cores] if plan.trainer_cores else []
            for path in plan.paths:
                command = [*bound, sys.executable, "-m", "bench.trainer", "--kind", kind]
                if path in ("loopback", "shm"):
                    argv, endpoint = exec_in(link, command), f"tcp://127.0.0.1:{port}"
                else:
                    link = replace(link, rate=path)
                    reshape(link)
                    argv, endpoint = command, f"tcp://{link.ns_addr}:{port}"
                trainer = Child(argv, workdir / f"{kind}-{path}-trainer.log", _env(), f"{kind} trainer ({path})")
                try:
                    measure_path(trainer, engine, endpoint, kind, path, plan, versions, seeds, rows, save)
                finally:
                    trainer.close()
        finally:
            engine.close()


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | path | density | sent as | wire / dense | delta s | dense s | B s | dense / delta | delta / B | dense / B | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["delta"]
        modes = "/".join(sorted(set(d["modes"])))
        b = statistics.median(d["baseline_b_all"] + r["dense"]["baseline_b_all"])
        lines.append(f"| {r['model']} | {r['path']} | {r['density']:.1%} | {modes} | {r['wire_over_dense']:.2%} | {d['seconds']:.3f} | "
                     f"{r['dense']['seconds']:.3f} | {b:.3f} | {r['dense_over_delta']:.2f} | {r['delta_over_b']:.2f} | "
                     f"{r['dense_over_b']:.2f} | {r['load_average_start'][0]:.1f} |")
    return "\n".join(lines)


def _spread(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals: at 1% density the wire at most 5% of dense; on the 1 Gb/s link deltas at least 10x faster
    than dense (at 1%); on loopback the delta sync at most 1.2x baseline B (350m, at 1%). Each ratio is the row's
    medians' (the verdict's figure), followed by each sync's against the same denominator (the spread within the
    run); over 1 Gb/s also the bar as a multiple of B measured in the same row (dense / B / 10: where it is near 1,
    the goal asks a delta sync as fast as vLLM's own reload of weights already in the worker)."""
    out = []
    for r in rows:
        if r["density"] != 0.01:
            continue
        name = f"{r['model']} {r['path']} 1%"
        syncs = r.get("delta", {}).get("seconds_all") or []
        out.append(f"{name}: wire {r['wire_over_dense']:.2%} of dense (goal <= 5%): {'met' if r['wire_over_dense'] <= 0.05 else 'MISSED'}")
        if r["path"] == "1gbit":
            each = f"; per sync {_spread([r['dense']['seconds'] / s for s in syncs], '.1f')}x" if syncs else ""
            out.append(f"{name}: dense / delta {r['dense_over_delta']:.1f}x (goal >= 10x{each}): "
                       f"{'met' if r['dense_over_delta'] >= 10 else 'MISSED'}")
            if "dense_over_b" in r:
                out.append(f"{name}: the 10x bar is a delta sync of {r['dense']['seconds'] / 10:.3f} s, "
                           f"{r['dense_over_b'] / 10:.2f}x baseline B in this row")
        if r["path"] == "loopback":
            b = r["delta"]["seconds"] / r["delta_over_b"] if syncs else 0.0  # the row's median B
            each = f"; per sync {_spread([s / b for s in syncs], '.2f')}" if syncs else ""
            out.append(f"{name}: delta / B {r['delta_over_b']:.2f} (goal <= 1.2 at 350m{each}): "
                       f"{'met' if r['delta_over_b'] <= 1.2 else 'MISSED'}")
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = parse(argv)
    if os.geteuid() != 0:
        print("bench.delta_link needs root (ip netns, ip link, tc)", file=sys.stderr)
        return 2
    started = time.time()
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows: list[dict[str, Any]] = []
    versions, seeds = Versions(), Versions()
    out = plan.out or RESULTS / f"{time.strftime('%Y-%m-%d-%H%M', time.gmtime(started))}-delta-{'-'.join(plan.models)}.json"

    def save(done: bool = False) -> None:
        """The results so far (``complete`` once every row is in), written after each row."""
        result = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "seconds": time.time() - started,
                  "complete": done, "command": "python -m bench.delta_link " + " ".join(sys.argv[1:] if argv is None else argv),
                  "host": os.uname().nodename, "cpus": os.cpu_count(), "reps": plan.reps, "mode": plan.mode,
                  "trainer_cores": plan.trainer_cores or "unbound",
                  "bucket_mb": plan.bucket_mb, "uptime_start": uptime_start,
                  "uptime_now": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  "engine": "vLLM (vllm-cpu), TP 1, bfloat16, in namespace " + NAMESPACE,
                  "auth": "transport.allow_unauthenticated: true (plain ZMQ, no CURVE)",
                  "rows": rows, "verdict": verdict(rows)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory(prefix="wb-delta-bench-") as tmp:
        try:
            for kind in plan.models:
                run_model(kind, plan, Path(tmp), versions, seeds, rows, save)
        except BaseException:
            for log in sorted(Path(tmp).glob("*.log")):
                tail = log.read_text(errors="replace")[-3000:]
                print(f"---- {log.name} (tail)\n{tail}", file=sys.stderr)
            raise
    save(done=True)
    print(table(rows))
    for line in verdict(rows):
        print(line)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
