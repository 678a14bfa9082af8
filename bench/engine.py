"""The benchmark's engine: an InferenceServer with the two baselines and process ids for memory readings."""

from __future__ import annotations

import os
import time
from typing import Any

from inference_side.server import InferenceServer, resolve_config


class BenchServer(InferenceServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("worker_extension_cls", "bench.worker.BaselineWorker")
        super().__init__(*args, **kwargs)

    def set_config(self, config: dict[str, Any]) -> None:
        """Switch sync settings (e.g. ``sync.mode``) between measurements without a restart."""
        self.config = resolve_config(config)
        self.receiver.config = self.config

    def baseline_a_reload(self, path: str) -> float:
        """Baseline A's second half: vLLM's ``reload_weights(weights_path=...)`` on every worker."""
        with self._serving():
            t0 = time.perf_counter()
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            seconds = time.perf_counter() - t0
            self.llm.reset_prefix_cache()
        return seconds

    def baseline_b(self, seed: int) -> float:
        """Baseline B: in-process ``reload_weights`` from tensors already in each worker (slowest rank)."""
        with self._serving():
            reports = self.llm.collective_rpc("wb_baseline_reload", args=(seed,))
            self.llm.reset_prefix_cache()
        return max(float(r["seconds"]) for r in reports)

    def pids(self) -> list[int]:
        """This process and every process it started (the vLLM engine core and its workers)."""
        import psutil

        me = psutil.Process(os.getpid())
        return [me.pid, *[c.pid for c in me.children(recursive=True)]]


def bench_actor() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_concurrency=8)(BenchServer)  # type: ignore[call-overload]
