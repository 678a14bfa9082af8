"""Shared fixtures and pytest hooks: receivers in this process, a real local Ray, checkpoints. Helpers
(paths, child processes, weights, manifests, the oracle) are in tests/helpers.py, the engine fake in
tests/fakes.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import start_local_ray


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--soak-full", action="store_true", help="run the full 200-sync soak")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)"))
    # the tests on the shared namespace cluster run last, back to back: it starts once, idles through no other test
    # and is torn down (and checked for leftovers) as soon as they are done
    on_cluster = [item for item in items if "netns_cluster" in getattr(item, "fixturenames", ())]
    if on_cluster:
        items[:] = [item for item in items if item not in on_cluster] + on_cluster


@pytest.fixture(scope="session")
def netns_cluster() -> Any:
    """The session's 3-node namespace cluster (see ``NETNS``; root only). After the last test on it, nothing it
    made is left: no link or namespace of its prefix, no process of its temp dir (a failure there is an error at
    that test's teardown)."""
    import os

    import psutil

    from devtools.netns_cluster import NamespaceCluster
    from tests.helpers import NETNS, NETNS_WORKER_RESOURCE, free_port, netns_leftovers

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    extra = {"RAY_memory_monitor_refresh_ms": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cluster = NamespaceCluster(2, **NETNS, num_cpus=2, dashboard_port=free_port(),
                               worker_resources={NETNS_WORKER_RESOURCE: 1.0}, extra_env=extra)
    with cluster:
        yield cluster
    left = netns_leftovers(str(NETNS["prefix"]))
    assert not left, f"the namespace cluster left links or namespaces behind:\n{left}"
    procs = [p.pid for p in psutil.process_iter(["cmdline"]) if cluster.temp_dir in " ".join(p.info["cmdline"] or [])]
    assert not procs, f"the namespace cluster left processes behind: {procs}"


@pytest.fixture
def start_receiver() -> Any:
    """start(config, gate, events=None) -> a running SyncReceiver in this process with ``gate`` behind it
    (``events`` collects its (kind, data) events); every one started is stopped after the test, and a
    ``FakeEngine`` behind one must have seen the engine contract kept (no ``violations``)."""
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
    broken = {rx.endpoint: rx.gate.violations for rx in made if getattr(rx.gate, "violations", None)}
    assert not broken, f"the receiver broke the engine contract: {broken}"


@pytest.fixture(scope="session")
def ray_session() -> Any:
    import ray

    start_local_ray()
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
