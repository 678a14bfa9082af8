"""Seconds of each pass over the model in one delta sync's CPU work, in this process: the publisher's up-front
sample and its encode in place, the receiver's patch into its base store and the store's adoption (no engine, no
wire; the engine's load is baseline B's work, measured by ``bench.delta_link``). Docs: docs/benchmarks.md, "Delta
updates".

    PYTHONPATH=$PWD python -m bench.delta_passes [--model 350m] [--density 0.01] [--steps 3] [--bucket-mb 64]

Each step makes the next version (``bench.delta_link.rl_step_``) of a bf16 model, encodes it against the
publisher's base bucket by bucket (``encode_in_place``; its compare, ``changed_positions``, and the payload's
encode, ``encode_bytes``, timed apart), writes the wire buckets into receive segments, patches them into a
``BaseStore`` that adopted the previous version (``BaseStore.patch``) and adopts the result; the store is then
checked bit-identical to the trainer's tensors. Prints one JSON line per step (the first warms the pages).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="350m")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    args = p.parse_args(argv)

    import os

    import numpy as np
    import torch

    from bench.delta_link import rl_step_
    from bridge import wire
    from bridge.shm import SegmentPool
    from devtools.tiny_models import build_model
    from inference_side.contract import StagedBucket
    from inference_side.delta_base import BaseStore
    from trainer_side import delta_publish as dp
    from trainer_side.packing import make_plan, pack_bucket, plan_specs

    named = [(n, t.detach()) for n, t in build_model(args.model, 1).named_parameters()]
    plan, tensors = make_plan(named, "bfloat16", int(args.bucket_mb * (1 << 20)))
    manifest = wire.Manifest(version=1, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes, checksum="xxh3")
    base = dp.Snapshot.empty(manifest)
    pool = SegmentPool("passes")
    pool.trim(1 << 40)
    store = BaseStore()
    staged = []
    for i, size in enumerate(manifest.bucket_sizes):
        base.buffers[i] = torch.empty(size, dtype=torch.uint8)
        base.sums[i] = tuple(pack_bucket(plan, tensors, i, base.buffers[i], checksum="xxh3"))
        seg = pool.take(size)
        np.frombuffer(seg.buffer, dtype=np.uint8)[:] = base.buffers[i].numpy()
        staged.append(StagedBucket(i, seg, list(manifest.by_bucket()[i]), base.sums[i]))
    store.adopt(manifest, staged, b"bench", pool)
    seconds: dict[str, float] = {}

    def timed(key: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
        return run

    dp.changed_positions = timed("publisher: compare and new checksum (changed_positions)", dp.changed_positions)  # type: ignore[assignment]
    dp.encode_bytes = timed("publisher: payload encode (encode_bytes)", dp.encode_bytes)  # type: ignore[assignment]
    try:
        for step in range(args.steps):
            seconds.clear()
            rl_step_([t for _, t in named], args.density, 7 + step)
            new_manifest = wire.Manifest(version=manifest.version + 1, tensors=manifest.tensors,
                                         bucket_sizes=manifest.bucket_sizes, checksum="xxh3")
            why = timed("publisher: up-front sample", dp.plan_update)(base, new_manifest, plan, tensors)
            if why:
                raise SystemExit(f"the sample says dense: {why}")
            new = dp.Snapshot.empty(new_manifest)
            encoded = []
            t0 = time.perf_counter()
            for i in range(len(manifest.bucket_sizes)):
                result, sums = dp.encode_in_place(base, plan, tensors, i, dp.Buffers())
                new.buffers[i], new.sums[i] = base.buffers[i], sums
                assert result is not None, "a bucket went whole"
                encoded.append(result)
            seconds["publisher: encode in place, all"] = time.perf_counter() - t0
            wires = []
            for i, (table, items, _) in enumerate(encoded):
                seg = pool.take(table.size)
                view = np.frombuffer(seg.buffer, dtype=np.uint8)
                for offset, data in items:
                    raw = data if isinstance(data, np.ndarray) else np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
                    view[offset:offset + raw.size] = raw
                wires.append(StagedBucket(i, seg, table.wire_specs(new_manifest, i), ()))
            patched = [timed("receiver: patch in place (BaseStore.patch)", store.patch)(new_manifest, table, i, wires[i], b"bench", "reject")
                       for i, (table, _, _) in enumerate(encoded)]
            timed("receiver: adopt", store.adopt)(new_manifest, patched, b"bench", pool)
            for w in wires:
                pool.give(w.segment)
            for name, t in named:
                assert bytes(store.tensors[name]) == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name
            base, manifest = new, new_manifest
            print(json.dumps({"step": step, "model": args.model, "density": args.density, "model_bytes": manifest.total_bytes,
                              "wire_bytes": sum(e[0].wire_bytes for e in encoded), "load_average": os.getloadavg()[0],
                              "seconds": {k: round(v, 3) for k, v in seconds.items()}}), flush=True)
    finally:
        store.clear()
        pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
