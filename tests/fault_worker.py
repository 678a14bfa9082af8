"""A test-only worker extension: the weight-sync worker that can be told to fail inside the next update.

Engines started with ``worker_extension_cls=FAULT_WORKER`` take ``collective_rpc("wb_arm_failure", (name,))``:
every TP worker then raises once, inside the next update, when it reaches tensor ``name`` (after loading
began). ``collective_rpc("wb_arm_lora_corruption")``: the next LoRA read-back first flips one value of the
registered adapter's B in the engine's own LoRA weights (as a faulty load would leave it), so the read-back must
find it. The product's worker has no such hook.
"""

from __future__ import annotations

from typing import Any

from inference_side.reload_session import ReloadSession
from inference_side.worker_ext import WeightSyncWorker

FAULT_WORKER = "tests.fault_worker.FaultInjectingWorker"


class FaultInjectingWorker(WeightSyncWorker):
    _fail_at: str | None = None
    _corrupt_lora = False

    def wb_arm_lora_corruption(self) -> bool:
        self._corrupt_lora = True
        return True

    def wb_lora_readback(self, lora_id: int, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        if self._corrupt_lora:
            self._corrupt_lora = False
            manager = self._wb_lora_manager()
            slot = manager.lora_index_to_id.index(lora_id)
            for layer in manager.modules.values():
                stacked = getattr(layer, "lora_b_stacked", ())
                for b in stacked:
                    if b[slot, 0].count_nonzero():
                        b[slot, 0].view(-1)[b[slot, 0].view(-1).nonzero()[0, 0]] *= 2  # one value of B, doubled
                        return super().wb_lora_readback(lora_id, tensors, config)
        return super().wb_lora_readback(lora_id, tensors, config)

    def wb_arm_failure(self, name: str) -> str:
        self._fail_at = name
        return name

    def _wb_load_tensors(self, session: ReloadSession, tensors: list[tuple[str, Any]]) -> None:
        name = self._fail_at
        if name is None or all(n != name for n, _ in tensors):
            super()._wb_load_tensors(session, tensors)
            return
        self._fail_at = None
        for n, tensor in tensors:
            if n == name:
                raise RuntimeError(f"test-only injected failure while loading {n}")
            session.load(n, tensor)
