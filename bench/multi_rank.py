"""Multi-rank publishing (trainer_side/multi_rank.py): time per version and each rank's memory.

**Timing rows** (``--models``): the real model shapes of devtools.tiny_models (``350m``, ``1b``; bfloat16,
built on the meta device so each rank allocates only its own FSDP2 shards) published by the single-process
``WeightPublisher`` (the baseline, in the same run) and by 1, 2 and 4 gloo ranks under FSDP2 ``fully_shard``
(``RankedPublisher``), each over shm and ZMQ (tcp), into one receiver in this process that stages and
verifies every bucket (per range) with no engine behind it (``bench.run.NullGate``: the engine's load is the
same work whoever sent the bytes, so it is left out). Time: ``publish()`` on rank 0, to the verified ack. Three
phases per model and transport (``PHASES``): single-process against 1 rank, 1 rank against 2, 1 rank against
4, the two groups of a phase alive at once and taking turns (which goes first alternates each repetition);
one warm-up version per group, then the median of ``--reps``; ratios are medians of ratios paired within a
repetition (this host is shared and its load changes by the minute). Every process runs one torch thread.
Memory per rank: peak RSS growth during each publish (``VmHWM`` after
resetting it) and the peak of its /dev/shm pages (``RssShmem``, sampled every 5 ms), against the bound: its
share of the update in /dev/shm (shm) or ``(depth + 1)`` packing buffers of a bucket (zmq), plus
``CONSTANT_BYTES``.

    python -m bench.multi_rank --models 350m,1b --reps 5 --bucket-mb 64 --port 46160 --json out.json

**Delta rows** (``--models ... --deltas``): per model and transport the single-process publisher and 2 ranks,
both with ``sync.delta`` on, and 2 ranks with it off, each into a receiver of its own, every version about 0.8%
of the elements changed (``deltas``).

    python -m bench.multi_rank --models 350m --deltas --reps 5 --bucket-mb 64 --port 46160 --json out.json

**Memory only** (no ``--models``): memory of each trainer rank during a multi-rank publish, against what the
design bounds it by: its own shards plus, with ZMQ, ``depth + 1`` packing buffers of its share of a bucket,
and one local tensor cast to the travel dtype.

N gloo ranks (subprocesses) hold an FSDP2-sharded stack of ``[hidden, hidden]`` fp32 layers and publish it
(travel dtype bfloat16) to one receiver in this process that stages and verifies every bucket with no engine
behind it (``bench.run.NullGate``). Each rank resets its peak RSS
(``bench.memory``) before each of two publishes and reports its peak RSS growth during each (the first
allocates the packing ring, the second reuses it); shm's pages in
/dev/shm that a rank wrote count in its RSS (``RssShmem``) and are reported apart.

    python -m bench.multi_rank --ranks 2 --transport zmq --layers 16 --hidden 2048 --bucket-mb 16 --port 44300

The model, the ranks and the receiver share this host (the ranks' control channel is host-local).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _rank(rank: int, world: int, port: int, endpoint: str, transport: str, layers: int, hidden: int,
          bucket_mb: float, depth: int, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.memory import _status, reset_peaks
    from bridge.config import config_from_dict
    from trainer_side.multi_rank import RankedPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    # deltas off: this measures the sharded data plane (each rank's ranges straight to the engines), which a
    # multi-rank publish with sync.delta on replaces by the model assembled on rank 0's host
    config = config_from_dict({"transport": {"kind": transport, "bucket_mb": bucket_mb, "depth": depth},
                               "deadlines": {"bucket_s": 300, "manifest_s": 300}, "sync": {"delta": False}})
    pid = os.getpid()
    growth = []
    with RankedPublisher([endpoint], config=config) as publisher:
        for version in (1, 2):
            gc.collect()
            before = reset_peaks([pid])[pid]
            report = publisher.publish(model.state_dict(), version)
            status = _status(pid)
            growth.append(max(status.get("VmHWM", before) - before, 0))
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "shard_bytes": shard_bytes, "first_publish_growth_bytes": growth[0],
        "second_publish_growth_bytes": growth[1], "rss_shmem_bytes": status.get("RssShmem", 0),
        "seconds": report.seconds.get("total", 0.0), "ok": report.ok}))
    dist.destroy_process_group()


def run(ranks: int, transport: str, layers: int, hidden: int, bucket_mb: float, depth: int, port: int) -> dict[str, Any]:
    from bench.run import NullGate
    from bridge.config import config_from_dict
    from inference_side.receiver import SyncReceiver

    receiver = SyncReceiver(NullGate(), config_from_dict({"transport": {"listen_ipc": True}}))
    receiver.start()
    try:
        endpoint = receiver.ipc_endpoint or receiver.endpoint
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            procs = [subprocess.Popen([sys.executable, "-m", "bench.multi_rank", "--as-rank", str(r), "--ranks", str(ranks),
                                       "--port", str(port), "--endpoint", endpoint, "--transport", transport,
                                       "--layers", str(layers), "--hidden", str(hidden), "--bucket-mb", str(bucket_mb),
                                       "--depth", str(depth), "--out", out], cwd=ROOT, env=env)
                     for r in range(ranks)]
            codes = [p.wait(timeout=1800) for p in procs]
            if any(codes):
                raise RuntimeError(f"ranks exited with {codes}")
            rows = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]
    finally:
        receiver.stop()
    bucket = int(bucket_mb * (1 << 20))
    tensor = hidden * hidden * 4 // ranks  # one local fp32 shard; its bf16 cast is half that
    for row in rows:
        # the bound: ZMQ: (depth + 1) packing buffers of at most one bucket each + one local tensor cast
        row["bound_bytes"] = ((depth + 1) * bucket if transport == "zmq" else 0) + tensor // 2
    return {"ranks": ranks, "transport": transport, "model_bytes_fp32": layers * hidden * hidden * 4,
            "bucket_bytes": bucket, "depth": depth, "rows": rows}


# ---- the timing rows: real model shapes, 1/2/4 ranks against the single-process publisher ---------------------

TRANSPORTS = ("shm", "zmq")
# each phase: the groups alive at once (the single-process WeightPublisher, or N ranks), their rows interleaved; two
# groups a phase keep the 1b model's memory (each group's model and its update in /dev/shm) within what this
# shared host has free; the 1-rank group in every phase links the phases' ratios
PHASES = ((("single", 1), ("ranks", 1)), (("ranks", 1), ("ranks", 2)), (("ranks", 1), ("ranks", 4)))
CONSTANT_BYTES = 32 << 20  # the stated constant of the bound: allocator free lists, Python objects, sampling slack


def _meta_model(kind: str) -> Any:
    """``kind``'s model (a devtools.tiny_models preset, bfloat16) built on the meta device: no rank ever
    holds more than it is given (``_fill``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from devtools.tiny_models import dense_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(dense_config(kind), dtype=torch.bfloat16)


def _fill(model: Any, seed: int) -> None:
    """Allocate this process's part of ``model`` (its local shards under FSDP2) and give it random values."""
    import torch

    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.uniform_(-0.05, 0.05, generator=gen)


class _Sampler:
    """Samples this process's RssShmem and anonymous RSS (VmRSS - RssShmem) every ``every_s`` while a
    publish runs; VmHWM gives the exact peak of the total."""

    def __init__(self, every_s: float = 0.005) -> None:
        import threading

        self.every_s = every_s
        self.shm = 0
        self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from bench.memory import _status

        pid = os.getpid()
        while True:
            s = _status(pid)
            shm = s.get("RssShmem", 0)
            self.shm = max(self.shm, shm)
            self.anon = max(self.anon, s.get("VmRSS", 0) - shm)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _serve(group: str, rank: int, world: int, port: int, endpoint: str, kind: str, transport: str, bucket_mb: float,
           depth: int, delta: bool = False) -> None:
    """One process of a timing group: build its part of the model, then answer ``publish`` commands (JSON
    lines on stdin) with its time and memory (JSON lines on stdout) until ``quit``. With ``delta``, the group
    publishes with ``sync.delta`` on, and each ``prepare`` that names a ``step`` changes the model
    (``devtools.tiny_models.halve_where_bits_end_in``)."""
    import gc
    import time

    import torch

    from bench.memory import _status, reset_peaks
    from bridge.config import config_from_dict
    from devtools.tiny_models import halve_where_bits_end_in

    torch.set_num_threads(1)  # every process one thread (torchrun's default for several ranks): see docs/benchmarks.md
    # no delta updates (but in the delta rows): the rows measure the sharded plane and the dense single-process path
    config = config_from_dict({"sync": {"mode": "staged", "delta": delta},
                               "transport": {"bucket_mb": bucket_mb, "depth": depth},
                               "deadlines": {"bucket_s": 600, "manifest_s": 600, "ack_s": 600, "heartbeat_s": 10}})
    model = _meta_model(kind)
    publisher: Any
    if group == "single":
        from trainer_side.publisher import WeightPublisher

        _fill(model, 0)
        publisher = WeightPublisher([endpoint], config=config, transport=transport)
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from trainer_side.multi_rank import RankedPublisher

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _fill(model, rank)
        publisher = RankedPublisher([endpoint], config=config, transport=transport)
    shard_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    state = model.state_dict()
    pid = os.getpid()
    gc.collect()
    gc.freeze()  # the model's objects: a collection before each publish then takes milliseconds, not a second
    largest = max(t.numel() * t.element_size() for t in state.values())  # a DTensor's numel is the full tensor's
    print(json.dumps({"ready": True, "rank": rank, "shard_bytes": shard_bytes, "largest_tensor_bytes": largest,
                      "rss": _status(pid).get("VmRSS", 0)}), flush=True)
    before: dict[str, int] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "prepare":  # every rank collects and resets its peak before any of them starts publishing
            if cmd.get("step"):
                halve_where_bits_end_in(model, int(cmd["step"]))
            gc.collect()
            before = _status(pid)
            reset_peaks([pid])
            print(json.dumps({"prepared": True}), flush=True)
            continue
        with _Sampler() as sampler:
            t0 = time.perf_counter()
            report = publisher.publish(state, int(cmd["version"]))
            seconds = time.perf_counter() - t0
        after = _status(pid)
        print(json.dumps({
            "rank": rank, "ok": report.ok, "seconds": seconds, "report_total": report.seconds.get("total", 0.0),
            "mode": report.delta.get("mode", "dense"), "wire_ratio": report.delta.get("ratio", 1.0),
            "rss_before": before.get("VmRSS", 0), "peak_rss": after.get("VmHWM", 0),
            "growth": max(after.get("VmHWM", 0) - before.get("VmRSS", 0), 0),
            "shm_growth": max(sampler.shm - before.get("RssShmem", 0), 0),
            "anon_growth": max(sampler.anon - (before.get("VmRSS", 0) - before.get("RssShmem", 0)), 0)}), flush=True)
    publisher.close()
    if group != "single":
        import torch.distributed as dist

        dist.destroy_process_group()


class _Group:
    """The processes of one timing group (``single``: one WeightPublisher; ``ranks``: N FSDP2 ranks)."""

    def __init__(self, group: str, world: int, port: int, endpoint: str, kind: str, transport: str, bucket_mb: float,
                 depth: int, delta: bool = False) -> None:
        self.name = "single-process" if group == "single" else f"{world} rank" + ("s" if world > 1 else "")
        if delta:
            self.name += ", deltas"
        self.group, self.world, self.transport = group, world, transport
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "bench.multi_rank", "--serve", group, "--as-rank", str(r), "--ranks", str(world),
             "--port", str(port), "--endpoint", endpoint, "--model", kind, "--transport", transport, "--bucket-mb", str(bucket_mb),
             "--depth", str(depth), *(["--delta"] if delta else [])], cwd=ROOT, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
            for r in range(world)]
        self.ready: list[dict[str, Any]] = []

    def _read(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: a process exited ({proc.wait()})")
            if line.startswith("{"):
                return dict(json.loads(line))

    def wait_ready(self) -> None:
        self.ready = [self._read(p) for p in self.procs]

    def _tell(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        return [self._read(p) for p in self.procs]

    def publish(self, version: int, step: int = 0) -> list[dict[str, Any]]:
        """Every process collects its garbage and resets its peak RSS (after changing its model by
        ``halve_where_bits_end_in`` when ``step`` is given), then all publish ``version`` at once."""
        self._tell({"op": "prepare", "step": step})
        answers = self._tell({"op": "publish", "version": version})
        if not all(a["ok"] for a in answers):
            raise RuntimeError(f"{self.name} over {self.transport}: version {version} failed: {answers}")
        return answers

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _median(values: list[float]) -> float:
    import statistics

    return float(statistics.median(values))


def _per_rank(group: _Group, seen: list[list[dict[str, Any]]], bucket_bytes: int, depth: int) -> list[dict[str, Any]]:
    """Each rank's memory over a row's versions (the first allocates; the warm ones reuse) against its bound:
    its peak RSS during any publish, above its RSS once its shards were built (before the first publish)."""
    ranks = []
    for r, ready in enumerate(group.ready):
        mine = [answers[r] for answers in seen]
        ranks.append({"rank": r, "shard_bytes": ready["shard_bytes"], "rss_at_start": ready["rss"],
                      "growth_first": mine[0]["growth"], "growth_max_warm": max(m["growth"] for m in mine[1:]),
                      "anon_growth_max_warm": max(m["anon_growth"] for m in mine[1:]),
                      "shm_growth_first": mine[0]["shm_growth"],
                      "shm_growth_max_warm": max(m["shm_growth"] for m in mine[1:]),
                      "peak_rss_max": max(m["peak_rss"] for m in mine)})
        bound(ranks[-1], group.transport, bucket_bytes, depth, ready["largest_tensor_bytes"])
    return ranks


def bound(row: dict[str, Any], transport: str, bucket_bytes: int, depth: int, largest_tensor_bytes: int) -> None:
    """Add to a rank's ``row`` its peak above its start and the bound of it: zmq, the packing ring of
    ``depth + 1`` buffers, each at most one bucket (a bucket is as large as its largest tensor where that
    exceeds ``bucket_bytes``); shm, the rank's own ranges, written into the /dev/shm segments (RssShmem, in its
    RSS while it maps them); plus ``CONSTANT_BYTES``."""
    ring = (depth + 1) * max(bucket_bytes, largest_tensor_bytes) if transport == "zmq" else 0
    share = row["shard_bytes"] if transport == "shm" else 0
    row["peak_above_start"] = row["peak_rss_max"] - row["rss_at_start"]
    row["bound_bytes"] = ring + share + CONSTANT_BYTES
    row["within_bound"] = row["peak_above_start"] <= row["bound_bytes"]


def timing(models: list[str], reps: int, bucket_mb: float, depth: int, port: int,
           transports: tuple[str, ...] = TRANSPORTS, phases_run: tuple[int, ...] = (0, 1, 2)) -> dict[str, Any]:
    """For each model and transport (shm, ZMQ over tcp), three phases (``PHASES``): the single-process
    ``WeightPublisher`` against 1 FSDP2 rank, then 1 rank against 2 and against 4 (``RankedPublisher``), into a
    receiver in this process with no engine behind it (NullGate: it stages and verifies every bucket, per
    range, and applies nothing). In a phase: one warm-up version per group, then ``reps`` repetitions, the
    two groups alternating which goes first; ratios are medians of ratios paired within a repetition.
    Ports: the receivers ``port`` to ``port + 11``, the groups' process groups ``port + 12`` to ``port + 35``."""
    import time

    from bench.run import NullGate
    from bridge.config import config_from_dict
    from inference_side.receiver import SyncReceiver

    bucket_bytes = int(bucket_mb * (1 << 20))
    out: dict[str, Any] = {"bucket_bytes": bucket_bytes, "depth": depth, "reps": reps, "constant_bytes": CONSTANT_BYTES,
                           "receiver": "SyncReceiver(NullGate) in the benchmark's process, staged, tcp",
                           "models": {}, "load_before": os.getloadavg()}
    version, phase_no, group_no = 1, 0, 0
    t0 = time.perf_counter()
    for kind in models:
        phases = []
        for transport in transports:
            for spec in (PHASES[i] for i in phases_run):
                config = config_from_dict({"sync": {"mode": "staged", "delta": False},
                                           "transport": {"bucket_mb": bucket_mb, "depth": depth}})
                receiver = SyncReceiver(NullGate(), config, port=port + phase_no)
                phase_no += 1
                receiver.start()
                groups: list[_Group] = []
                try:
                    for g, w in spec:
                        groups.append(_Group(g, w, port + 12 + group_no, receiver.endpoint, kind, transport, bucket_mb, depth))
                        group_no += 1
                    for group in groups:
                        group.wait_ready()
                    seconds: dict[str, list[float]] = {g.name: [] for g in groups}
                    seen: dict[str, list[list[dict[str, Any]]]] = {g.name: [] for g in groups}
                    for rep in range(reps + 1):
                        for group in groups if rep % 2 == 0 else groups[::-1]:
                            version += 1
                            answers = group.publish(version)
                            seen[group.name].append(answers)
                            if rep:
                                seconds[group.name].append(answers[0]["seconds"])
                    first, second = (g.name for g in groups)
                    phases.append({
                        "transport": transport, "groups": [g.name for g in groups],
                        "seconds": seconds, "median_s": {n: _median(t) for n, t in seconds.items()},
                        "ratio": _median([b / a for a, b in zip(seconds[first], seconds[second], strict=True)]),
                        "per_rank": {g.name: _per_rank(g, seen[g.name], bucket_bytes, depth) for g in groups},
                        "load_after": os.getloadavg()})
                    print(f"{kind} {transport} {first} / {second}: {phases[-1]['median_s']}, ratio {phases[-1]['ratio']:.2f} "
                          f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
                finally:
                    for group in groups:
                        group.close()
                    receiver.stop()
        out["models"][kind] = {"phases": phases, "rows": _rows(phases) if phases_run == (0, 1, 2) else []}
    out["load_after"] = os.getloadavg()
    return out


def deltas(models: list[str], reps: int, bucket_mb: float, depth: int, port: int,
           transports: tuple[str, ...] = TRANSPORTS) -> dict[str, Any]:
    """The delta rows: per model and transport three groups alive at once, each into a receiver of its own
    (``SyncReceiver(NullGate)``, deltas on: it keeps its base and rebuilds each delta): the single-process
    ``WeightPublisher`` and 2 FSDP2 ranks (``RankedPublisher``: the model assembled on rank 0's host), both with
    ``sync.delta`` on, and 2 ranks with it off (the sharded plane, dense). Before each version every group's
    model takes the same step (``halve_where_bits_end_in``: about 0.8% of the elements changed). Two warm-up versions (the first dense
    for everyone: no base yet), then ``reps`` repetitions, the groups' order rotating; ratios are medians of
    ratios paired within a repetition. Ports: the receivers ``port`` on, the process groups ``port + 12`` on."""
    import time

    from bench.run import NullGate
    from bridge.config import config_from_dict
    from inference_side.receiver import SyncReceiver

    bucket_bytes = int(bucket_mb * (1 << 20))
    out: dict[str, Any] = {"bucket_bytes": bucket_bytes, "depth": depth, "reps": reps, "models": {},
                           "step": "every element whose bf16 bits end in k halved (about 0.8% each version)",
                           "receiver": "SyncReceiver(NullGate) per group in the benchmark's process, staged, deltas on",
                           "load_before": os.getloadavg()}
    specs = (("single", 1, True), ("ranks", 2, True), ("ranks", 2, False))
    version, n = 1, 0
    t0 = time.perf_counter()
    for kind in models:
        rows = []
        for transport in transports:
            receivers, groups = [], []
            try:
                for g, w, delta in specs:
                    config = config_from_dict({"sync": {"mode": "staged", "delta": True},
                                               "transport": {"bucket_mb": bucket_mb, "depth": depth}})
                    receivers.append(SyncReceiver(NullGate(), config, port=port + n))
                    receivers[-1].start()
                    groups.append(_Group(g, w, port + 12 + n, receivers[-1].endpoint, kind, transport, bucket_mb, depth, delta))
                    n += 1
                for group in groups:
                    group.wait_ready()
                seconds: dict[str, list[float]] = {g.name: [] for g in groups}
                modes: dict[str, list[tuple[str, float]]] = {g.name: [] for g in groups}
                for rep in range(reps + 2):
                    version += 1
                    turn = rep % len(groups)
                    for group in groups[turn:] + groups[:turn]:
                        answers = group.publish(version, step=version % 127 + 1)
                        if rep >= 2:
                            seconds[group.name].append(answers[0]["seconds"])
                            modes[group.name].append((answers[0]["mode"], answers[0]["wire_ratio"]))
                single, ranked, dense = (g.name for g in groups)
                row = {"transport": transport, "median_s": {k: _median(v) for k, v in seconds.items()}, "seconds": seconds,
                       "modes": modes,
                       "ranks_delta_over_single_delta": _median([b / a for a, b in zip(seconds[single], seconds[ranked], strict=True)]),
                       "ranks_delta_over_ranks_dense": _median([b / a for a, b in zip(seconds[dense], seconds[ranked], strict=True)]),
                       "load_after": os.getloadavg()}
                rows.append(row)
                print(f"{kind} {transport}: {row['median_s']}, 2 ranks deltas / single deltas "
                      f"{row['ranks_delta_over_single_delta']:.2f}, / 2 ranks dense {row['ranks_delta_over_ranks_dense']:.2f} "
                      f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
            finally:
                for group in groups:
                    group.close()
                for receiver in receivers:
                    receiver.stop()
        out["models"][kind] = rows
    out["load_after"] = os.getloadavg()
    return out


def _rows(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table: per transport the single-process publisher, then 1, 2 and 4 ranks; ``ratio_to_1_rank`` paired
    within its phase, ``ratio_to_single_process`` chained through the 1-rank group (phase 1's ratio)."""
    rows = []
    for transport in TRANSPORTS:
        mine = [p for p in phases if p["transport"] == transport]
        base = mine[0]
        one = base["ratio"]  # 1 rank / single-process
        rows.append({"transport": transport, "publisher": "single-process", "ranks": 1,
                     "median_s": base["median_s"]["single-process"], "ratio_to_single_process": 1.0,
                     "ratio_to_1_rank": 1.0 / one, "per_rank": base["per_rank"]["single-process"]})
        rows.append({"transport": transport, "publisher": "1 rank", "ranks": 1, "median_s": base["median_s"]["1 rank"],
                     "ratio_to_single_process": one, "ratio_to_1_rank": 1.0, "per_rank": base["per_rank"]["1 rank"]})
        for phase in mine[1:]:
            name = phase["groups"][1]
            rows.append({"transport": transport, "publisher": name, "ranks": int(name.split()[0]),
                         "median_s": phase["median_s"][name], "one_rank_median_s": phase["median_s"]["1 rank"],
                         "ratio_to_1_rank": phase["ratio"], "ratio_to_single_process": phase["ratio"] * one,
                         "per_rank": phase["per_rank"][name]})
    return rows


def print_table(result: dict[str, Any]) -> None:
    mib = 1 << 20
    print("| model | transport | publisher | median s/version | × 1 rank (paired) | × single-process | per rank: shard MiB, "
          "peak RSS above start MiB (of it /dev/shm), bound MiB |")
    print("|---|---|---|---|---|---|---|")
    for kind, m in result["models"].items():
        for row in m["rows"]:
            ranks = "; ".join(f"r{p['rank']}: {p['shard_bytes'] / mib:.0f}, {p['peak_above_start'] / mib:.0f} "
                              f"({p['shm_growth_first'] / mib:.0f}), {p['bound_bytes'] / mib:.0f}"
                              f"{'' if p['within_bound'] else ' OVER'}" for p in row["per_rank"])
            print(f"| {kind} | {row['transport']} | {row['publisher']} | {row['median_s']:.2f} | "
                  f"{row['ratio_to_1_rank']:.2f} | {row['ratio_to_single_process']:.2f} | {ranks} |")
    m = result["models"].get("1b")
    row = next((r for r in m["rows"] if r["transport"] == "shm" and r["publisher"] == "2 ranks"), None) if m else None
    if row:
        verdict = "holds" if row["ratio_to_1_rank"] <= 1.0 else "does NOT hold"
        print(f"\n2 ranks over shm, 1b: {row['ratio_to_1_rank']:.2f} × 1 rank (paired), "
              f"{row['ratio_to_single_process']:.2f} × the single-process publisher: '2 ranks ≤ 1 rank' {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="timing rows for these devtools.tiny_models presets (e.g. 350m,1b)")
    parser.add_argument("--reps", type=int, default=5, help="timing rows: repetitions after the warm-up")
    parser.add_argument("--json", default="", help="timing rows: write the results here")
    parser.add_argument("--transports", default="shm,zmq", help="timing rows: over these")
    parser.add_argument("--phases", default="0,1,2",
                        help="timing rows: of PHASES (0: single-process and 1 rank, 1: 1 and 2 ranks, 2: 1 and 4 ranks)")
    parser.add_argument("--deltas", action="store_true",
                        help="with --models: the delta rows (single-process and 2 ranks with deltas, 2 ranks dense) instead")
    parser.add_argument("--delta", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--transport", choices=("zmq", "shm"), default="zmq")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--bucket-mb", type=float, default=16)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--port", type=int, default=44300,
                        help="MASTER_PORT of the ranks' gloo group; timing rows: the receiver's port, the groups' the next 4")
    parser.add_argument("--as-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--serve", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.as_rank, args.ranks, args.port, args.endpoint, args.model, args.transport, args.bucket_mb,
               args.depth, args.delta)
        return
    if args.as_rank >= 0:
        _rank(args.as_rank, args.ranks, args.port, args.endpoint, args.transport, args.layers, args.hidden,
              args.bucket_mb, args.depth, args.out)
        return
    if args.models and args.deltas:
        result = deltas(args.models.split(","), args.reps, args.bucket_mb, args.depth, args.port,
                        tuple(args.transports.split(",")))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        for kind, rows in result["models"].items():
            for row in rows:
                print(f"| {kind} | {row['transport']} | " + " | ".join(f"{v:.3f}" for v in row["median_s"].values())
                      + f" | {row['ranks_delta_over_single_delta']:.2f} | {row['ranks_delta_over_ranks_dense']:.2f} |")
        return
    if args.models:
        result = timing(args.models.split(","), args.reps, args.bucket_mb, args.depth, args.port,
                        tuple(args.transports.split(",")), tuple(int(i) for i in args.phases.split(",")))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        print_table(result)
        return
    print(json.dumps(run(args.ranks, args.transport, args.layers, args.hidden, args.bucket_mb, args.depth, args.port)))


if __name__ == "__main__":
    main()
