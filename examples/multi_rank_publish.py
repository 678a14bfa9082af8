"""Publishing from every rank of a torchrun trainer: tiny Qwen2 under FSDP2 ``fully_shard`` (gloo, CPU), each
rank writing only its own shards into the engine's shared-memory buckets (``trainer_side.multi_rank``).

Start an engine on this host first (it prints the endpoint to publish to), then the trainer ranks::

    python examples/multi_rank_publish.py engine --out /tmp/wb-mr      # leave it running
    torchrun --nproc-per-node 2 --master-port 18450 examples/multi_rank_publish.py train \\
        --endpoint "$(cat /tmp/wb-mr/endpoint)" --steps 3

Each step changes the sharded weights in place (no optimizer: a fixed scale, enough to change the served
outputs) and publishes them as the next version; rank 0 prints one JSON line per version (bytes, seconds,
verified). ``DTensor.full_tensor`` is made to raise in the ranks, so a gather anywhere would fail the run.
The engine side prints the greedy tokens of a fixed prompt after each version it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIG = {"transport": {"kind": "shm", "bucket_mb": 0.25}}
PROMPT = [1, 2, 3, 4, 5]


def engine(out: Path, seconds: float) -> None:
    """An InferenceServer (no Ray) on a tiny Qwen2 checkpoint; writes its ipc endpoint to OUT/endpoint."""
    from devtools.tiny_models import make_checkpoint
    from inference_side import InferenceServer

    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint("tiny", out / "v0", seed=1)
    server = InferenceServer(model=str(ckpt), tensor_parallel_size=1, dtype="bfloat16", config=CONFIG)
    endpoint = server.endpoint("ipc")
    (out / "endpoint").write_text(endpoint)
    print(f"engine serving v0 at {endpoint} (for {seconds:.0f}s)", flush=True)
    served, end = server.version(), time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if server.version() != served:
                served = server.version()
                (out_,) = server.generate([PROMPT], max_tokens=6)
                print(f"engine serves v{served}: {out_['token_ids']}", flush=True)
            time.sleep(0.5)
    finally:
        server.shutdown()


def train(endpoint: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from bridge.config import config_from_dict
    from devtools.tiny_models import build_model
    from trainer_side.multi_rank import RankedPublisher

    dist.init_process_group("gloo")  # rank, world and rendezvous from torchrun's environment
    rank = dist.get_rank()

    def no_gather(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a rank gathered a full tensor")

    DTensor.full_tensor = no_gather  # type: ignore[method-assign]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model("tiny", seed=2)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with RankedPublisher([endpoint], config=config_from_dict(CONFIG)) as publisher:
        for version in range(1, steps + 1):
            if version > 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().mul_(0.9)  # this rank's shard only
            report = publisher.publish(model.state_dict(), version=version)
            if rank == 0:
                print(json.dumps({"version": version, "ranks": dist.get_world_size(), "bytes": report.bytes,
                                  "seconds": round(report.seconds["total"], 3),
                                  "verified": all(e.verified for e in report.engines)}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="start an engine on this host and wait")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--seconds", type=float, default=600)
    t = sub.add_parser("train", help="one trainer rank (run under torchrun)")
    t.add_argument("--endpoint", required=True)
    t.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.cmd == "engine":
        engine(args.out, args.seconds)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        train(args.endpoint, args.steps)


if __name__ == "__main__":
    main()
