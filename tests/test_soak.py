"""Many consecutive syncs leak nothing: tiny GPT-OSS, generation between syncs. Every sync passes
the audit; resident memory and open descriptors of the actor's whole process tree (actor + vLLM engine
and worker processes) stay flat; the final outputs equal a cold-loaded engine of the last version.

Bounded in CI (50 syncs); ``make soak`` (``pytest -m soak tests/test_soak.py --soak-full``) runs 200.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, generate, oracle

pytestmark = [pytest.mark.engine, pytest.mark.soak]

SEEDS = (11, 12, 13)  # versions cycle through these weights, so every sync changes the model
WARMUP = 10  # syncs before the slope is measured: allocator pools, vLLM caches and zmq buffers settle
# Bounds, per sync, on the slope fitted after warm-up. The model is ~1.5 MB in bfloat16; a leak of any
# per-sync object that holds the weights (a bucket, a staged segment, a host tensor) is >= 1.5 MB/sync,
# so 256 KiB/sync is ~6x below the smallest leak that matters while above the allocator's noise seen here.
RSS_SLOPE_MAX = 256 * 1024
FD_SLOPE_MAX = 0.05  # one descriptor leaked every 20 syncs would fail


def slope(ys: list[float]) -> float:
    """Least-squares slope of ys against their index."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((x - mx) ** 2 for x in range(n))
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / den if den else 0.0


def tree_usage(pid: int) -> tuple[int, int]:
    """Resident bytes and open descriptors of a process and all its descendants."""
    import psutil

    rss = fds = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
        except psutil.NoSuchProcess:
            continue
    return rss, fds


def shm_segments(*pids: int) -> int:
    """Shared-memory segments created by these processes (receiver staging, publisher buckets)."""
    return sum(1 for pid in pids for _ in Path("/dev/shm").glob(f"wb-*-{pid}-*"))


def test_soak(request: Any, ray_session: Any, checkpoints: Any) -> None:
    from devtools.tiny_models import build_model
    from inference_side import InferenceActor
    from trainer_side import WeightPublisher

    syncs = 200 if request.config.getoption("--soak-full") else 50
    ray = ray_session
    actor = InferenceActor.remote(model=str(checkpoints("gpt_oss", 1)), tensor_parallel_size=1, dtype="bfloat16",
                                  name="soak-engine")
    try:
        endpoint = ray.get(actor.endpoint.remote(), timeout=600)
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        weights = {seed: list(build_model("gpt_oss", seed).named_parameters()) for seed in SEEDS}
        rss: list[float] = []
        fds: list[float] = []
        shm: list[int] = []
        t0 = time.perf_counter()
        with WeightPublisher([endpoint]) as pub:
            for version in range(2, syncs + 2):
                report = pub.publish(weights[SEEDS[version % len(SEEDS)]], version=version)
                (eng,) = report.engines
                assert report.ok and eng.verified and not eng.noop, eng
                assert eng.engine["tensors_audited"] > 0 and eng.engine["stale_tensors"] == [], eng.engine
                assert eng.engine["routed_sinks"] == 2 and eng.engine["routed_bypass"] == 8, eng.engine
                outs = generate(actor)
                assert all(len(o["token_ids"]) == 8 for o in outs)
                r, f = tree_usage(pid)
                rss.append(r)
                fds.append(f)
                shm.append(shm_segments(pid, os.getpid()))
        elapsed = time.perf_counter() - t0
        assert ray.get(actor.version.remote()) == syncs + 1
        rss_slope, fd_slope = slope(rss[WARMUP:]), slope(fds[WARMUP:])
        print(f"\nSOAK {syncs} syncs in {elapsed:.1f}s ({elapsed / syncs:.2f}s per sync incl. generation); "
              f"actor tree RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB, slope {rss_slope / 1024:+.1f} KiB/sync; "
              f"open fds {fds[0]:.0f} -> {fds[-1]:.0f}, slope {fd_slope:+.4f}/sync; segments left in /dev/shm max {max(shm)}")
        assert rss_slope < RSS_SLOPE_MAX, f"resident memory grows {rss_slope / 1024:.1f} KiB per sync"
        assert fd_slope < FD_SLOPE_MAX, f"open descriptors grow {fd_slope:.3f} per sync"
        # between syncs only the receive segments kept for the next update and the delta base (the last applied
        # update's buckets, kept by the receiver) remain; this model: one bucket each
        assert set(shm[WARMUP:]) == {shm[WARMUP]} and shm[WARMUP] <= 3, f"shared-memory segments between syncs: {shm}"
        last_seed = SEEDS[(syncs + 1) % len(SEEDS)]
        (cold,) = oracle([checkpoints("gpt_oss", last_seed)], 1, "bfloat16")
        assert_same_outputs(generate(actor), cold)
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
