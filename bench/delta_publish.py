"""Publish seconds with delta updates on and off (docs/delta.md): a 50m-size model (tiny Qwen2 preset)
published to receivers in this process with a ``bench.run.NullGate`` behind each (the receiver's
verification, rebuild and base copy run; nothing is applied), over ``--transport`` (zmq).

    PYTHONPATH=$PWD python -m bench.delta_publish [--preset 50m] [--repeats 5] [--transport zmq] [--bucket-mb 64]

Two series: random versions (every element new: all go dense) and versions that change 1% of the elements
(an optimizer-like step). In each, every version is published by a publisher with ``sync.delta`` false and
one with it true, in turn (two receivers), so both meet the same load on a shared machine; the median of
``--repeats`` publishes after one to set the base, and the median of the per-version ratios on / off; also
the CPU seconds of each publish (this process: the publisher and the receiver's threads), which the load of
a shared machine moves less than wall seconds. Prints one JSON line per series.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def versions(preset: str, count: int, density: float | None, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` + 1 versions of the preset's weights: fresh random values each (``density`` None), or each a
    step changing ``density`` of the previous one's elements."""
    import torch

    from bench.delta_codec import rl_step
    from devtools.tiny_models import build_model

    first = {n: p.detach().clone() for n, p in build_model(preset, seed).named_parameters()}
    out = [first]
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(count):
        prev = out[-1]
        if density is None:
            out.append({n: (0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in prev.items()})
        else:
            out.append({n: rl_step(t.reshape(-1), density, gen).reshape(t.shape) for n, t in prev.items()})
    return out


def pair(endpoints: list[str], config: Any, transport: str, weights: list[dict[str, Any]], first_version: int) -> dict[str, Any]:
    """Every version published by two publishers in turn (the order alternating), ``sync.delta`` false to the
    first receiver and true to the second, so both see the same load; the first version of each sets the base."""
    from trainer_side import WeightPublisher

    runs: dict[bool, dict[str, list[Any]]] = {d: {"seconds": [], "cpu": [], "modes": [], "ratio": [], "encode": []} for d in (False, True)}
    base_bytes = 0
    with WeightPublisher([endpoints[0]], config=config.replace(sync={"delta": False}), transport=transport) as off, \
            WeightPublisher([endpoints[1]], config=config.replace(sync={"delta": True}), transport=transport) as on:
        for i, named in enumerate(weights):
            for delta in ((False, True) if i % 2 else (True, False)):
                publisher = on if delta else off
                t0, c0 = time.perf_counter(), time.process_time()
                report = publisher.publish(named, version=first_version + i)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                if i == 0:
                    continue  # sets the base (and warms the buffers)
                run = runs[delta]
                run["seconds"].append(elapsed)
                run["cpu"].append(cpu)
                run["modes"].append(report.delta.get("mode", "off"))
                run["ratio"].append(report.delta.get("ratio", 1.0))
                run["encode"].append(round(report.seconds.get("encode", 0.0), 4))
        base_bytes = on.base_bytes
    out: dict[str, Any] = {}
    for delta, run in runs.items():
        key = "on" if delta else "off"
        out[key] = {"median_s": round(statistics.median(run["seconds"]), 4), "seconds": [round(x, 4) for x in run["seconds"]],
                    "median_cpu_s": round(statistics.median(run["cpu"]), 4),
                    "modes": run["modes"], "wire_ratio": run["ratio"], "encode_s": run["encode"]}
    out["on_over_off"] = round(statistics.median(b / a for a, b in zip(runs[False]["seconds"], runs[True]["seconds"], strict=True)), 3)
    out["base_bytes"] = base_bytes
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.run import NullGate
    from bridge.config import BridgeConfig
    from inference_side.receiver import SyncReceiver

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="50m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transport", default="zmq")
    parser.add_argument("--port", type=int, default=0, help="the two receivers' ports: this one and the next (0: any)")
    parser.add_argument("--bucket-mb", type=float, default=BridgeConfig().transport.bucket_mb)
    args = parser.parse_args(argv)

    config = BridgeConfig().replace(serve={"sweep_vllm_shm": False}, transport={"bucket_mb": args.bucket_mb})
    receivers = [SyncReceiver(NullGate(), config, port=args.port + i if args.port else 0) for i in range(2)]
    endpoints = [rx.start() for rx in receivers]
    try:
        random = versions(args.preset, args.repeats, None)
        total = sum(t.numel() * t.element_size() for t in random[0].values())
        print(json.dumps({"preset": args.preset, "bytes": total, "transport": args.transport, "bucket_mb": args.bucket_mb}), flush=True)
        print(json.dumps({"series": "random (all dense)", **pair(endpoints, config, args.transport, random, 1)}), flush=True)
        del random
        stepped = versions(args.preset, args.repeats, 0.01)
        print(json.dumps({"series": "1% density", **pair(endpoints, config, args.transport, stepped, 100)}), flush=True)
    finally:
        for rx in receivers:
            rx.stop()


if __name__ == "__main__":
    main()
