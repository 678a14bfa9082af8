"""The benchmark's worker extension: the weight-sync worker plus baseline B, measured inside each worker."""

from __future__ import annotations

import time
from typing import Any

from inference_side.mapped_buckets import torch_dtype
from inference_side.worker_ext import WeightSyncWorker


class BaselineWorker(WeightSyncWorker):
    def wb_baseline_reload(self, seed: int) -> dict[str, Any]:
        """Baseline B: vLLM's own in-process ``reload_weights`` from a list of tensors that already sit in
        this worker (made here from ``seed``, untimed). Returns the reload's seconds and bytes."""
        import torch

        from bridge.checkpoint import read_tensor_table

        table = read_tensor_table(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        dtype = torch_dtype(self.vllm_config.model_config.dtype.__str__().removeprefix("torch."))  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(seed)
        tensors = []
        for name, entry in table.items():
            noise = torch.randn(entry.shape, generator=gen, dtype=torch.float32)
            value = 1.0 + 0.1 * noise if "norm" in name and len(entry.shape) == 1 else 0.05 * noise
            tensors.append((name, value.to(dtype if entry.dtype in ("bfloat16", "float16", "float32") else torch_dtype(entry.dtype))))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes}
