"""Delta codec sizes and speeds (docs/delta.md): one bf16 tensor, an RL-step-like change at each density.

    PYTHONPATH=$PWD python -m bench.delta_codec [--numel 4194304] [--repeats 3] [--checksum xxh3]

Prints, per density, the encoding chosen, its bytes as a share of dense, each encoding's size when forced,
and encode / apply throughput in MB of dense tensor per second (best of ``--repeats``; single thread).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

DENSITIES = (0.0, 0.001, 0.01, 0.05, 0.3, 1.0)


def rl_step(base: Any, density: float, gen: Any, scale: float = 1e-2) -> Any:
    """``base`` with ``density`` of its elements scaled by 1 + ``scale`` * N(0, 1) (an optimizer step)."""
    import torch

    new = base.clone()
    k = round(base.numel() * density)
    idx = torch.randperm(base.numel(), generator=gen)[:k]
    new[idx] = (base[idx].float() * (1 + scale * torch.randn(k, generator=gen))).to(base.dtype)
    return new


def best_of(repeats: int, fn: Any) -> tuple[Any, float]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def main(argv: list[str] | None = None) -> None:
    import torch

    from bridge import delta

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checksum", default="xxh3")
    parser.add_argument("--scale", type=float, default=1e-2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(args.numel, generator=gen) * 0.02).to(torch.bfloat16)
    dense_mb = base.numel() * 2 / 1e6
    print(f"bf16, {base.numel()} elements ({dense_mb:.1f} MB), checksum {args.checksum}, load average {os.getloadavg()[0]:.1f}")
    print("| density | changed bits | chosen | wire / dense | sparse | xor | dense | encode MB/s | apply MB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = torch.empty_like(base)
    for density in DENSITIES:
        new = rl_step(base, density, gen, args.scale)
        d, t_enc = best_of(args.repeats, lambda new=new: delta.encode(base, new, name="w", base_version=0, checksum=args.checksum))
        _, t_apply = best_of(args.repeats, lambda d=d, out=out: delta.apply(base, d, out=out))
        assert torch.equal(out.view(torch.int16), new.view(torch.int16))
        forced = {e: delta.encode(base, new, name="w", base_version=0, encodings=(e,)).spec.nbytes / d.spec.dense_nbytes
                  for e in delta.ENCODINGS}
        spec = d.spec
        print(f"| {density:g} | {spec.changed / spec.numel:.4f} | {spec.encoding}/{spec.codec} | {spec.nbytes / spec.dense_nbytes:.2%} | "
              + " | ".join(f"{forced[e]:.2%}" for e in delta.ENCODINGS)
              + f" | {dense_mb / t_enc:.0f} | {dense_mb / t_apply:.0f} |")


if __name__ == "__main__":
    main()
