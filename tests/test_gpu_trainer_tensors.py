"""A trainer's weights live on its GPU: the publisher packs them straight from device memory.

GPU machines only (marker ``gpu``; ``scripts/gpu_check.sh`` runs this module there with no vLLM needed).
Two receiver processes (tests/recording_receiver.py: no model; each reports the crc32 of every tensor it
staged) take three versions over shm and ZMQ, staged and streaming. The oracle is the same tensors moved to
the CPU and cast there: every receiver's bytes must equal theirs. The tensors mix what a trainer holds:
float32 master weights cast to the engine's bfloat16 on the way, bfloat16 ones, a transposed (non-contiguous)
view, a 0-dim scalar, an integer buffer, an empty tensor and one larger than a packing chunk.

``python -m tests.test_gpu_trainer_tensors`` prints how fast packing reads CUDA tensors against the same bytes
on the CPU (the publisher's ``pack`` seconds and ``pack_bucket`` alone, medians of five) and how fast bytes
come off the GPU.
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests import recording_receiver as recording

SMALL = {"transport": {"bucket_mb": 1, "depth": 2}}


def _weights(seed: int, device: str) -> list[tuple[str, Any]]:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    return [
        ("model.embed_tokens.weight", rand(300, 64)),  # float32 master weight: cast to bfloat16 on the way
        ("model.layers.0.self_attn.qkv_proj.weight", rand(192, 64, dtype=torch.bfloat16)),
        ("model.layers.0.self_attn.o_proj.weight", rand(64, 160).t()),  # transposed view: not contiguous
        ("model.layers.0.self_attn.sinks", rand(4, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.scale", rand(1).reshape(())),  # 0-dim
        ("model.layers.0.mlp.steps", torch.arange(seed, seed + 17, device=device, dtype=torch.int64)),
        ("model.layers.0.mlp.empty", torch.empty(0, 8, device=device)),
        ("model.layers.1.mlp.down_proj.weight", rand(1100, 1024, dtype=torch.bfloat16)),  # over a 1 MiB chunk
        ("model.norm.weight", rand(64)),
    ]


def _expected(weights: list[tuple[str, Any]]) -> dict[str, int]:
    """crc32 of each tensor moved to the CPU first, floats cast to bfloat16 there."""
    import torch

    out = {}
    for name, t in weights:
        cpu = t.detach().cpu()
        cpu = cpu.to(torch.bfloat16) if cpu.is_floating_point() else cpu
        out[name] = zlib.crc32(cpu.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(params=["staged", "streaming"])
def receivers(request: Any) -> Iterator[tuple[dict[str, Any], list[str]]]:
    config = {**SMALL, "sync": {"mode": request.param}}
    procs, endpoints = recording.start(config, 2)
    try:
        yield config, endpoints
    finally:
        recording.stop(procs)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_cuda_trainer_tensors_reach_every_receiver_bit_exact(receivers: Any, transport: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config, endpoints = receivers
    publish_and_compare(config, endpoints, transport, "cuda")


def publish_and_compare(config: dict[str, Any], endpoints: list[str], transport: str, device: str) -> None:
    from bridge.config import config_from_dict
    from trainer_side import WeightPublisher

    with WeightPublisher(endpoints, config=config_from_dict(config), transport=transport) as pub:
        for version in (1, 2, 3):  # later versions reuse the publisher's buffers
            weights = _weights(version, device)
            assert all(t.device.type == device for _, t in weights)
            report = pub.publish(weights, version)
            want = _expected(weights)
            assert report.ok and len(report.engines) == 2, report
            for engine in report.engines:
                wrong = sorted(n for n, c in want.items() if engine.engine["crc32"].get(n) != c)
                assert not wrong, f"{transport} v{version} {engine.endpoint}: bytes differ for {wrong}"


def pack_speed(gib: float = 1.0, reps: int = 5) -> dict[str, float]:
    """Publisher ``pack`` seconds (median) for the same bfloat16 bytes held on the CUDA GPU and on the CPU,
    over shm to one receiver."""
    import torch

    from bridge.config import config_from_dict
    from trainer_side import WeightPublisher

    per = 64 << 20  # 64 MiB tensors, in 64 MiB buckets
    count = max(int(gib * (1 << 30)) // per, 1)
    cuda = [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(per // 2, device="cuda").to(torch.bfloat16))
            for i in range(count)]
    cpu = [(n, t.cpu()) for n, t in cuda]
    config = {"transport": {"bucket_mb": 64, "depth": 2}, "sync": {"mode": "staged"}}
    procs, endpoints = recording.start(config, 1)
    out: dict[str, float] = {"bytes": float(count * per)}
    try:
        with WeightPublisher(endpoints, config=config_from_dict(config), transport="shm") as pub:
            version = 0
            for label, weights in (("cpu", cpu), ("cuda", cuda), ("cpu", cpu), ("cuda", cuda)):
                packs = []
                for _ in range(reps):
                    version += 1
                    packs.append(pub.publish(weights, version).seconds["pack"])
                out[label] = statistics.median(packs)
    finally:
        recording.stop(procs)
    return out


def copy_speeds(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """GB/s (median) of ways to bring one CUDA tensor's bytes to host memory, no checksum: one copy into
    pageable memory, the same in 1 MiB chunks (as packing copies now), one copy into pinned memory."""
    import time

    import torch

    from trainer_side.packing import PACK_CHUNK_BYTES

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(0)  # fault the pages in
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def chunked() -> None:
        for start in range(0, nbytes, PACK_CHUNK_BYTES):
            pageable[start : start + PACK_CHUNK_BYTES].copy_(src[start : start + PACK_CHUNK_BYTES])

    ways = {"pageable": lambda: pageable.copy_(src), "pageable_1MiB_chunks": chunked, "pinned": lambda: pinned.copy_(src)}
    out = {}
    for label, way in ways.items():
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            way()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[label] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def pack_bucket_speeds(reps: int = 5) -> dict[str, float]:
    """GB/s (median) of ``pack_bucket`` with xxh3 over 1 GiB of bfloat16 in 64 MiB tensors: held on the CPU,
    held on the GPU, and on the GPU copied in 1 MiB chunks each summed before the next is copied (the
    packing before the overlapped device copy), all in this run."""
    import time

    import torch

    from trainer_side import packing

    per, count = 64 << 20, 16
    cuda = [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(per // 2, device="cuda").to(torch.bfloat16))
            for i in range(count)]
    held = {"cpu": [(n, t.cpu()) for n, t in cuda], "cuda": cuda}

    def serial(typed: Any, raw: memoryview, src: Any, hasher: Any) -> int:
        flat, width = src.contiguous().view(-1), typed.element_size()
        step = (1 << 20) // width
        for start in range(0, flat.numel(), step):
            typed[start : start + step].copy_(flat[start : start + step])
            hasher.update(raw[start * width : (start + step) * width])
        return int(hasher.intdigest())

    out = {}
    overlapped = packing._copy_from_device_and_sum
    for label, weights, way in (("cpu", held["cpu"], overlapped), ("cuda", cuda, overlapped),
                                ("cuda_serial_1MiB", cuda, serial)):
        plan, tensors = packing.make_plan(weights, "bfloat16", per)
        bufs = [torch.zeros(size, dtype=torch.uint8) for size in plan.bucket_sizes]
        packing._copy_from_device_and_sum = way
        times = []
        try:
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i, buf in enumerate(bufs):
                    packing.pack_bucket(plan, tensors, i, buf, checksum="xxh3")
                times.append(time.perf_counter() - t0)
        finally:
            packing._copy_from_device_and_sum = overlapped
        out[label] = per * count / statistics.median(times[1:]) / 1e9
    return out


if __name__ == "__main__":  # scripts/gpu_check.sh, after the tests: the figures
    speed = pack_speed()
    gb = speed["bytes"] / 1e9
    print(f"pack {gb:.2f} GB bfloat16 -> shm: CPU tensors {speed['cpu']:.3f} s ({gb / speed['cpu']:.1f} GB/s), "
          f"CUDA tensors {speed['cuda']:.3f} s ({gb / speed['cuda']:.1f} GB/s), CUDA/CPU {speed['cuda'] / speed['cpu']:.2f}x")
    print("pack_bucket xxh3, GB/s:", ", ".join(f"{k} {v:.1f}" for k, v in pack_bucket_speeds().items()))
    print("device to host copy, GB/s:", ", ".join(f"{k} {v:.1f}" for k, v in copy_speeds().items()))
