"""Build vLLM model classes in-process on CPU (TP 1, a one-process gloo group) and drive weight updates
through the worker extension exactly as the engine does (``wb_setup``, then ``wb_begin`` / ``wb_load`` /
``wb_finish`` with shared memory).

Used by tests/test_model_support.py. Everything here is real vLLM code: the model class, its loader
(``load_format="dummy"`` for random initial weights, or a real safetensors checkpoint), vLLM's
layerwise reload. The only shims are the two the CPU model runner itself applies before building a
model (``torch.accelerator`` no-ops and placeholder ``torch.Event`` / ``torch.cuda.Stream``), plus the
same placeholder for ``torch.cuda.Event``, which DeepSeek V4's attention creates in ``__init__``.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inference_side.worker_ext import WeightSyncWorker
from tests.helpers import free_port

_DIST: dict[str, bool] = {"ready": False}


class SpecConfig(SimpleNamespace):
    """A stand-in for ``SpeculativeConfig`` for constructing draft-model classes (DFlash, MTP):
    named fields as given, every other field ``None``."""

    def __getattr__(self, key: str) -> Any:
        return None


@contextmanager
def cpu_build_shims() -> Iterator[None]:
    import torch
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop, _torch_cuda_wrapper

    _set_torch_accelerator_to_noop()
    cuda_event = torch.cuda.Event
    try:
        with _torch_cuda_wrapper():
            torch.cuda.Event = torch.Event  # type: ignore[misc]  # the runner's placeholder
            yield
    finally:
        torch.cuda.Event = cuda_event  # type: ignore[misc]


def build(config: dict[str, Any], *, dtype: str = "bfloat16", model_dir: Path | None = None,
          load_format: str = "dummy", speculative: bool = False, **model_kwargs: Any) -> tuple[Any, Any]:
    """Construct and load a vLLM model class from ``config`` (written as config.json). Returns (model, vllm_config)."""
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.model_executor.model_loader import get_model_loader

    directory = Path(model_dir) if model_dir is not None else Path(tempfile.mkdtemp(prefix="wb-model-"))
    directory.mkdir(parents=True, exist_ok=True)
    if config:
        (directory / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
                               enforce_eager=True, **model_kwargs)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format=load_format))
    if speculative:
        object.__setattr__(vllm_config, "speculative_config",
                           SpecConfig(draft_model_config=model_config, num_speculative_tokens=1, method="dflash"))
    with set_current_vllm_config(vllm_config), cpu_build_shims():
        if not _DIST["ready"]:
            init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                         local_rank=0, backend="gloo")
            ensure_model_parallel_initialized(1, 1)
            _DIST["ready"] = True
        model = get_model_loader(vllm_config.load_config).load_model(vllm_config=vllm_config, model_config=model_config)
    return model, vllm_config


def shutdown() -> None:
    if _DIST["ready"]:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        _DIST["ready"] = False


class ModelWorker(WeightSyncWorker):
    """The worker extension on an in-process model: ``wb_setup`` and the update calls are the engine's own code."""

    def __init__(self, model: Any, vllm_config: Any) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = vllm_config


def apply(worker: ModelWorker, tensors: dict[str, Any], **options: Any) -> dict[str, Any]:
    """Stage ``tensors`` in one shared-memory bucket and apply them as one update through the worker's
    ``wb_begin`` / ``wb_load`` / ``wb_finish`` (as the engine does); the rank's report as a dict."""
    import torch

    from bridge.shm import Segment

    items = [(name, t.contiguous()) for name, t in tensors.items()]
    total = sum(t.numel() * t.element_size() for _, t in items)
    segment = Segment.create("modeltest", total)
    try:
        out = torch.frombuffer(segment.mm, dtype=torch.uint8, count=total)
        specs, offset = [], 0
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            out[offset:offset + nbytes].copy_(t.view(-1).view(torch.uint8))
            specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
            offset += nbytes
        del out
        begun = worker.wb_begin([name for name, _ in items], dict(options))
        if not begun.ok:
            return begun.to_dict()
        loaded = worker.wb_load({"segment": segment.name, "size": total, "tensors": specs})
        if not loaded.ok:
            worker.wb_abort()
            return loaded.to_dict()
        return worker.wb_finish().to_dict()
    finally:
        segment.close()


def save_table(model_dir: str | Path, tensors: dict[str, Any]) -> None:
    """Write ``tensors`` as the checkpoint's safetensors file (``wb_setup`` finds sinks there)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(model_dir) / "model.safetensors"))
