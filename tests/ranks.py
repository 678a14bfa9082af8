"""Running the trainer ranks of tests/ranks_worker.py (real processes, gloo on CPU) and the weights they
publish, for tests/test_multi_rank.py and tests/test_multi_rank_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, child_env, free_port_in

PORTS = range(18400, 18500)  # MASTER_PORT of the ranks' process group (WB_TEST_RANK_PORTS=lo-hi: another range)
if os.environ.get("WB_TEST_RANK_PORTS"):
    _lo, _hi = os.environ["WB_TEST_RANK_PORTS"].split("-")
    PORTS = range(int(_lo), int(_hi))


def master_port() -> int:
    port = free_port_in(PORTS)
    if port is None:
        raise AssertionError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")
    return port


def run_ranks(endpoint: str, scenario: str, world: int, out: Path, first: int = 2, kind: str = "tiny",
              timeout: float = 600, transport: str = "shm", shard: str = "rows") -> tuple[list[int], list[list[dict[str, Any]]], str]:
    """Start ``world`` ranks of ``scenario`` publishing to ``endpoint`` over ``transport`` (``shard``: how
    FSDP2 shards the model, tests/ranks_worker.py ``sharded_model``); their exit codes, each rank's results
    (empty for a rank that wrote none) and their logs."""
    port = master_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "ranks_worker.py"), str(r), str(world), str(port),
                               str(out), endpoint, scenario, str(first), kind, transport, shard],
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for r in range(world):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else [])
    return [p.returncode for p in procs], results, "\n".join(logs)[-6000:]


def torchrun(args: list[str], port: int, timeout: float = 600) -> tuple[int, str]:
    """Two ranks of tests/vllm_ranks_worker.py ``args`` under torchrun (MASTER_PORT ``port``), in a session of their
    own (killed together should they overrun ``timeout``): torchrun's exit code and log."""
    import signal

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(ROOT / "tests" / "vllm_ranks_worker.py"), *args]
    proc = subprocess.Popen(cmd, env=child_env(OMP_NUM_THREADS="1"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + f"\n(killed after {timeout:.0f} s)"
    return proc.returncode, log


def full_weights(seed: int, scale: float = 1.0, kind: str = "tiny") -> Any:
    """The unsharded model the ranks publish (``build_model(kind, seed)``, every parameter times ``scale``
    as the ranks scale their shards): the oracle's weights."""
    import torch

    from devtools.tiny_models import build_model

    model = build_model(kind, seed)
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    return model


def shard_geometry(out: Path, world: int) -> list[dict[str, list[Any]]]:
    """Each rank's ``{parameter: [placement, local shape]}`` as FSDP2 gave them (the ``versions`` scenario)."""
    return [json.loads((out / f"rank{r}-shards.json").read_text()) for r in range(world)]


def assert_fsdp2_split(geometry: list[dict[str, list[Any]]], full: Any) -> set[str]:
    """Every rank holds every parameter, sharded on one dim (``Shard(d)``) with torch's chunk sizes (``ceil(size / world)``
    per rank, the last ones fewer or none), the other dims whole; the placements seen."""
    import math

    world = len(geometry)
    seen = set()
    for name, tensor in full.state_dict().items():
        placements = {g[name][0] for g in geometry}
        assert len(placements) == 1, (name, placements)
        (placement,) = placements
        seen.add(placement)
        dim = int(placement.removeprefix("Shard(").removesuffix(")"))
        size, chunk = tensor.shape[dim], math.ceil(tensor.shape[dim] / world)
        for r, g in enumerate(geometry):
            expected = list(tensor.shape)
            expected[dim] = max(min(chunk, size - r * chunk), 0)
            assert g[name][1] == expected, (name, r, g[name], expected)
    return seen
