"""Shared fixtures: a real local Ray, real engines (one per module), trainer processes, the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 300, 400]]
ARTIFACTS = ROOT / "artifacts"


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--soak-full", action="store_true", help="run the full 200-sync soak")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)"))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


@pytest.fixture
def start_receiver() -> Any:
    """start(config, gate, events=None) -> a running SyncReceiver in this process with ``gate`` behind it
    (``events`` collects its (kind, data) events); every one started is stopped after the test."""
    from inference_side.receiver import SyncReceiver

    made: list[Any] = []

    def start(config: Any, gate: Any, events: list[tuple[str, dict[str, Any]]] | None = None) -> Any:
        rx = SyncReceiver(gate, config, on_event=(lambda k, d: events.append((k, d))) if events is not None else None)
        rx.start()
        made.append(rx)
        return rx

    yield start
    for rx in made:
        rx.stop()


@pytest.fixture(scope="session")
def ray_session() -> Any:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: Any) -> Any:
    """make(kind, seed) -> a checkpoint directory (cached per session)."""
    from devtools.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[tuple[str, int], Path] = {}

    def make(kind: str, seed: int) -> Path:
        key = (kind, seed)
        if key not in cache:
            cache[key] = make_checkpoint(kind, root / f"{kind}-s{seed}", seed)
        return cache[key]

    return make


_ORACLE_CACHE: dict[tuple[str, int, str], list[dict[str, Any]]] = {}


def oracle(models: list[Path], tp: int, dtype: str, prompts: list[list[int]] = PROMPTS) -> list[list[dict[str, Any]]]:
    """Greedy outputs of plain vLLM engines cold-loaded from each checkpoint (one subprocess)."""
    from devtools.coldload import cold_outputs

    todo = [str(m) for m in models if (str(m), tp, dtype) not in _ORACLE_CACHE]
    if todo:
        for model, outs in cold_outputs(todo, tp, dtype, prompts, env=child_env()).items():
            _ORACLE_CACHE[(model, tp, dtype)] = outs
    return [_ORACLE_CACHE[(str(m), tp, dtype)] for m in models]


def run_trainer(endpoint: str, kind: str, seeds: list[int], first_version: int, save_dir: Path | None = None,
                transport: str | None = None, config: str | None = None, timeout: float = 600) -> list[dict[str, Any]]:
    """Publish from a separate trainer process; return its JSON report lines."""
    cmd = [sys.executable, "-m", "apps.job", "--endpoint", endpoint, "--kind", kind, "--version", str(first_version)]
    for s in seeds:
        cmd += ["--seed", str(s)]
    if save_dir:
        cmd += ["--save-dir", str(save_dir)]
    if transport:
        cmd += ["--transport", transport]
    if config:
        cmd += ["--config", config]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=timeout, cwd=ROOT)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, f"trainer printed nothing (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return lines


def assert_same_outputs(got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["token_ids"] == w["token_ids"], f"prompt {i}: tokens {g['token_ids']} != cold-loaded {w['token_ids']}"
        for j, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"], strict=True)):
            assert abs(a - b) <= tol, f"prompt {i} token {j}: logprob {a} != cold-loaded {b}"


def generate(actor: Any, prompts: list[list[int]] = PROMPTS) -> list[dict[str, Any]]:
    import ray

    return ray.get(actor.generate.remote(prompts, max_tokens=8, logprobs=1))
