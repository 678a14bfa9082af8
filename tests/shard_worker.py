"""One trainer rank of tests/test_shards.py's real torch.distributed check: a small module sharded with
FSDP2 ``fully_shard`` over gloo on CPU, plus DTensors placed with ``distribute_tensor`` (Shard(1),
Replicate) and a plain tensor. The rank computes its ranges and their bytes from its local shards with
``DTensor.full_tensor`` and ``redistribute`` made to raise, gathers every rank's plan and (rank 0) agrees
the manifest; it writes what it sends to ``OUT/rank{R}.pt`` for the parent to reassemble.

Run: python tests/shard_worker.py RANK WORLD PORT OUT
"""

from __future__ import annotations

import os
import sys
from typing import Any


def build_model() -> Any:
    """The module every rank builds (and the parent, unsharded): uneven dim-0 sizes and a 1-row parameter
    that leaves rank 1 of 2 an empty shard."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 6)
            self.layers = nn.ModuleList([nn.Linear(6, 5), nn.Linear(5, 3)])
            self.row = nn.Parameter(torch.randn(1, 4))

    return Tiny().to(torch.bfloat16)


def extra_tensors() -> dict[str, Any]:
    """Tensors placed with distribute_tensor, and a plain one, as full tensors (identical on every rank)."""
    import torch

    return {"extra.col": torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7) / 7,
            "extra.rep": torch.arange(9, dtype=torch.float32).reshape(3, 3) - 4,
            "plain.buf": torch.arange(6, dtype=torch.int64)}


def main(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from bridge.shards import agree
    from trainer_side.shard_view import rank_plan

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = build_model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        full = extra_tensors()
        named: list[tuple[str, Any]] = list(model.state_dict().items())
        named.append(("extra.col", distribute_tensor(full["extra.col"], mesh, [Shard(1)])))
        named.append(("extra.rep", distribute_tensor(full["extra.rep"], mesh, [Replicate()])))
        named.append(("plain.buf", full["plain.buf"]))
        placements = {n: [str(p) for p in t.placements] for n, t in named if isinstance(t, DTensor)}

        def refuse(*_: Any, **__: Any) -> Any:
            raise AssertionError("a rank gathered a full tensor")

        DTensor.full_tensor = refuse  # type: ignore[method-assign]
        DTensor.redistribute = refuse  # type: ignore[method-assign]
        plan, views = rank_plan(named, rank)
        plans: list[Any] = [None] * world
        dist.all_gather_object(plans, plan)
        manifest = agree(plans, world).to_wire() if rank == 0 else None
        torch.save({"ranges": [r.to_wire() for r in plan.ranges], "bytes": [bytes(v.numpy()) for v in views],
                    "manifest": manifest, "placements": placements}, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()  # both ranks done with gloo before either tears it down (a rank leaving early aborted the other once)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
