"""Memory of each trainer rank during a multi-rank publish (trainer_side/multi_rank.py), against what the
design bounds it by: its own shards plus, with ZMQ, ``depth + 1`` packing buffers of its share of a bucket,
and one local tensor cast to the travel dtype.

N gloo ranks (subprocesses) hold an FSDP2-sharded stack of ``[hidden, hidden]`` fp32 layers and publish it
(travel dtype bfloat16) to one receiver in this process that stages and verifies every bucket with no engine
behind it (``bench.run.NullGate``). Each rank resets its peak RSS
(``bench.memory``) before each of two publishes and reports its peak RSS growth during each (the first
allocates the packing ring, the second reuses it); shm's pages in
/dev/shm that a rank wrote count in its RSS (``RssShmem``) and are reported apart.

    python -m bench.multi_rank --ranks 2 --transport zmq --layers 16 --hidden 2048 --bucket-mb 16 --port 44300
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
    config = config_from_dict({"transport": {"kind": transport, "bucket_mb": bucket_mb, "depth": depth},
                               "deadlines": {"bucket_s": 300, "manifest_s": 300}})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--transport", choices=("zmq", "shm"), default="zmq")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--bucket-mb", type=float, default=16)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--port", type=int, default=44300, help="MASTER_PORT of the ranks' gloo group")
    parser.add_argument("--as-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank >= 0:
        _rank(args.as_rank, args.ranks, args.port, args.endpoint, args.transport, args.layers, args.hidden,
              args.bucket_mb, args.depth, args.out)
        return
    print(json.dumps(run(args.ranks, args.transport, args.layers, args.hidden, args.bucket_mb, args.depth, args.port)))


if __name__ == "__main__":
    main()
