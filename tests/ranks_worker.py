"""One trainer rank of tests/test_multi_rank.py: tiny Qwen2 under FSDP2 ``fully_shard`` over gloo on CPU,
publishing with ``RankedPublisher`` (every rank its own shards; ``DTensor.full_tensor`` and ``redistribute``
made to raise in this process). Writes what each publish returned to ``OUT/rank{R}.json``.

Scenarios (the same on every rank unless said):
* ``versions``: versions FIRST (``build_model(KIND, FIRST)``, default 2) and FIRST + 1 (version FIRST's
  weights times 0.5, computed on the local shards);
* ``kill``: version 4 (``build_model("tiny", 4)``); rank 1 SIGKILLs itself (a test-side patch of the
  publisher's write) when it reaches bucket 1, a second after reporting bucket 0;
* ``corrupt``: version 6; rank 1 flips one bit of the first range it writes after summing it (a test-side
  patch of the publisher's write), as memory corrupted between the sum and the engine would;
* ``deltas`` (``sync.delta`` on): version FIRST, then ``DELTA_STEPS`` versions changing about one element in
  128 each (``step``), the fifth after another publisher's version FIRST + 100 (the rest numbered after it);
* ``adapter``: LoRA adapter ``ranks`` versions 1 and 2 (tests/test_lora.py's tensors of seeds 11 and 12), each
  rank its chunks (``lora_A`` column shards, ``lora_B`` row shards);
* ``SCENARIO+deltas``: that scenario with ``sync.delta`` on (the ranks assemble the model on rank 0's host);
* ``steal``: version 5; rank 1 claims rank 0's rows of ``model.norm.weight`` (a test-side patch of its
  block) instead of its own.

Run: python tests/ranks_worker.py RANK WORLD PORT OUT ENDPOINT SCENARIO [FIRST_VERSION [KIND [TRANSPORT [SHARD]]]]
(``versions`` publishes FIRST_VERSION and FIRST_VERSION + 1, default 2 and 3, and writes
each parameter's placement and local shape to ``OUT/rank{R}-shards.json``; KIND is a devtools.tiny_models
kind, ``tiny`` (Qwen2) unless given; TRANSPORT ``shm`` unless given, or ``zmq``; SHARD ``rows`` (every
parameter ``Shard(0)``) unless given, or ``mixed`` (square 2-D weights ``Shard(1)``: see ``sharded_model``).)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

# bucket_s far above the test's own deadlines: a dead rank must be found dead, not timed out; deltas off (these
# scenarios test the sharded data plane) but in ``deltas``
CONFIG = {"transport": {"kind": "shm", "bucket_mb": 0.25}, "deadlines": {"bucket_s": 300, "manifest_s": 120},
          "sync": {"delta": False}}
# ``deltas``: the versions after the first, each changing the elements whose float32 bits end in its number
DELTA_STEPS = 6


def step(model: Any, k: int) -> None:
    """Version ``first + k`` of the ``deltas`` scenario from version ``first + k - 1`` (about one element in 128
    halved: ``devtools.tiny_models.halve_where_bits_end_in``)."""
    from devtools.tiny_models import halve_where_bits_end_in

    halve_where_bits_end_in(model, k)


def sharded_model(seed: int, mesh: Any, kind: str = "tiny", shard: str = "rows") -> Any:
    """``build_model(kind, seed)`` under FSDP2 ``fully_shard`` (each layer, then the model): every parameter
    ``Shard(0)`` (``shard="rows"``, FSDP2's default), or with ``shard="mixed"`` the square 2-D weights
    ``Shard(1)`` (FSDP2's ``shard_placement_fn``; their ranges travel strided) and the rest ``Shard(0)``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from devtools.tiny_models import build_model

    def placement(param: Any) -> Any:
        return Shard(1) if shard == "mixed" and param.ndim == 2 and param.shape[0] == param.shape[1] else None

    model = build_model(kind, seed)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh)
    return model


def adapter_chunks(seed: int, mesh: Any) -> dict[str, Any]:
    """tests/test_lora.py's adapter tensors of ``seed``, this rank's chunks of them as DTensors: ``lora_A`` column
    shards (strided ranges), ``lora_B`` row shards."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from tests.test_lora import adapter_tensors

    rank, world = dist.get_rank(), dist.get_world_size()
    local = {}
    for name, full in adapter_tensors(seed).items():
        dim = 1 if "lora_A" in name else 0
        local[name] = DTensor.from_local(full.chunk(world, dim=dim)[rank].contiguous(), mesh, [Shard(dim)],
                                         run_check=False, shape=full.shape, stride=full.stride())
    return local


def geometry(model: Any) -> dict[str, list[Any]]:
    """Each parameter's placement and this rank's local shape, as FSDP2 gave them."""
    return {n: [f"Shard({t.placements[0].dim})", list(t.to_local().shape)] for n, t in model.state_dict().items()}


def main(rank: int, world: int, port: int, out: str, endpoint: str, scenario: str, first: int = 2,
         kind: str = "tiny", transport: str = "shm", shard: str = "rows") -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import trainer_side.multi_rank as multi_rank
    from bridge.config import config_from_dict
    from bridge.errors import BridgeError
    from trainer_side.multi_rank import RankedPublisher

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: list[dict[str, Any]] = []

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a rank gathered a full tensor")

    DTensor.full_tensor = refuse  # type: ignore[method-assign]
    DTensor.redistribute = refuse  # type: ignore[method-assign]
    mesh = init_device_mesh("cpu", (world,))
    config = {**CONFIG, "transport": {**CONFIG["transport"], "kind": transport}}
    if scenario.endswith("+deltas") or scenario == "deltas":  # "corrupt+deltas": that scenario, deltas on
        config["sync"] = {"delta": True}
        scenario = scenario.removesuffix("+deltas")
    publisher = RankedPublisher([endpoint], config=config_from_dict(config))

    def publish(model: Any, version: int) -> None:
        try:
            report = publisher.publish(model.state_dict(), version)
            results.append({"version": version, "ok": True, "bytes": report.bytes,
                            "verified": [e.verified for e in report.engines], "delta": report.delta,
                            "fallback": [e.dense_fallback for e in report.engines], "base_bytes": publisher.base_bytes})
        except BridgeError as exc:
            results.append({"version": version, "ok": False, "error": type(exc).__name__, "message": str(exc),
                            "reasons": getattr(exc, "reasons", {}), "ranks": list(getattr(exc, "ranks", ()))})
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)

    try:
        if scenario == "versions":
            model = sharded_model(first, mesh, kind, shard)
            with open(os.path.join(out, f"rank{rank}-shards.json"), "w") as f:
                json.dump(geometry(model), f)
            publish(model, first)
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().mul_(0.5)
            publish(model, first + 1)
        elif scenario == "deltas":
            # version FIRST (dense: no base), then DELTA_STEPS versions of a few changed elements each; before
            # the fifth, another publisher (rank 0, whole tensors of another model) puts its own version on the
            # engine, so the ranks' fifth delta names a base the engine no longer serves
            model = sharded_model(first, mesh, kind, shard)
            publish(model, first)
            for k in range(1, DELTA_STEPS + 1):
                if k == 5:
                    dist.barrier()
                    if rank == 0:
                        from devtools.tiny_models import build_model
                        from trainer_side.publisher import WeightPublisher

                        with WeightPublisher([endpoint], config=config_from_dict(config), name="interloper") as other:
                            other.publish(build_model(kind, 99).state_dict(), first + 100)
                    dist.barrier()
                step(model, k)
                publish(model, first + 100 + k if k >= 5 else first + k)
        elif scenario == "adapter":
            # a LoRA adapter ("ranks") from the ranks: tests.test_lora's tensors of seeds 11 (version 1) and 12
            # (version 2), each rank holding its chunk (A column shards: strided; B row shards)
            from tests.test_lora import adapter_spec

            for version, seed in ((1, 11), (2, 12)):
                try:
                    report = publisher.publish(adapter_chunks(seed, mesh), version, adapter=adapter_spec(name="ranks"))
                    results.append({"version": version, "ok": True, "engine": report.engines[0].engine})
                except BridgeError as exc:
                    results.append({"version": version, "ok": False, "error": type(exc).__name__, "message": str(exc)})
                with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                    json.dump(results, f)
        elif scenario == "kill":
            if rank == 1:
                write = multi_rank.RankedPublisher._write

                def dying_write(self: Any, index: int, *args: Any) -> Any:
                    if index == 1:
                        time.sleep(1.0)  # its report of bucket 0 leaves the socket first
                        os.kill(os.getpid(), signal.SIGKILL)
                    return write(self, index, *args)

                multi_rank.RankedPublisher._write = dying_write  # type: ignore[method-assign]
            publish(sharded_model(4, mesh), 4)
        elif scenario == "corrupt":
            if rank == 1:
                write = multi_rank.RankedPublisher._write

                def corrupting_write(self: Any, index: int, buffer: Any, specs: Any, mine: Any, *args: Any,
                                     packed: bool = False) -> Any:
                    sums = write(self, index, buffer, specs, mine, *args, packed=packed)
                    if index == 0 and mine:
                        at = 0 if packed else specs[mine[0].name].offset + mine[0].offset
                        buffer[at] ^= 1
                    return sums

                multi_rank.RankedPublisher._write = corrupting_write  # type: ignore[method-assign]
            publish(sharded_model(6, mesh), 6)
        elif scenario == "steal":
            if rank == 1:
                import dataclasses

                own = multi_rank.local_shard

                def stealing(name: str, tensor: Any, r: int, replica: int | None = None) -> Any:
                    shard = own(name, tensor, r, replica)
                    if name == "model.norm.weight":
                        return dataclasses.replace(shard, offset=(0,))  # rank 0's rows
                    return shard

                multi_rank.local_shard = stealing  # type: ignore[assignment]
            publish(sharded_model(5, mesh), 5)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    finally:
        publisher.close()
        if scenario != "kill":
            dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
         int(sys.argv[7]) if len(sys.argv) > 7 else 2, sys.argv[8] if len(sys.argv) > 8 else "tiny",
         sys.argv[9] if len(sys.argv) > 9 else "shm", sys.argv[10] if len(sys.argv) > 10 else "rows")
