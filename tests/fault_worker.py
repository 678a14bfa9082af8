"""A test-only worker extension: the weight-sync worker that can be told to fail inside the next update.

Engines started with ``worker_extension_cls=FAULT_WORKER`` take ``collective_rpc("wb_arm_failure", (name,))``:
every TP worker then raises once, inside the next update, when it reaches tensor ``name`` (after loading
began). The product's worker has no such hook.
"""

from __future__ import annotations

from typing import Any

from inference_side.reload_session import ReloadSession
from inference_side.worker_ext import WeightSyncWorker

FAULT_WORKER = "tests.fault_worker.FaultInjectingWorker"


class FaultInjectingWorker(WeightSyncWorker):
    _fail_at: str | None = None

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
