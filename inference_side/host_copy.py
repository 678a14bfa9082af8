"""``sync.host_copy``: the served weights kept in host memory, so a staged update that fails after loading
began can be rolled back instead of leaving the engine degraded.

The copy holds every tensor in checkpoint names, as the engine would receive it (floats in its dtype):
one full model in RAM. It is taken from the checkpoint at start and refreshed from each applied update's
staged buckets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge import wire
from bridge.report import RankReport, first_failure
from bridge.shm import Segment
from inference_side.contract import StagedBucket

logger = logging.getLogger(__name__)


class HostCopy:
    def __init__(self, model_path: str, dtype: str) -> None:
        import torch
        from safetensors.torch import load_file

        self.tensors: dict[str, Any] = {}
        for path in sorted(Path(model_path).glob("*.safetensors")):
            for name, tensor in load_file(str(path)).items():
                self.tensors[name] = tensor.to(getattr(torch, dtype)) if tensor.is_floating_point() else tensor
        logger.info("host copy of %d tensors", len(self.tensors))

    def keep(self, buckets: list[StagedBucket]) -> None:
        """Replace the copies of the tensors these (applied) buckets carried."""
        import torch

        for bucket in buckets:
            for spec in bucket.specs:
                raw = torch.frombuffer(bucket.segment.buffer, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset) \
                    if spec.nbytes else torch.empty(0, dtype=torch.uint8)
                self.tensors[spec.name] = raw.clone().view(getattr(torch, spec.dtype)).view(spec.shape)

    def bucket(self, manifest: wire.Manifest) -> StagedBucket:
        """One bucket, in a new segment, holding the copy of every tensor of ``manifest``: what to load to
        undo that update. The caller closes ``bucket.segment``."""
        import torch

        specs, values, offset = [], [], 0
        for spec in manifest.tensors:
            value = self.tensors[spec.name].contiguous()
            nbytes = value.numel() * value.element_size()
            specs.append(wire.TensorSpec(spec.name, str(value.dtype).removeprefix("torch."), tuple(value.shape), 0, offset, nbytes))
            values.append(value)
            offset += nbytes
        segment = Segment.create("restore", offset)
        out = torch.frombuffer(segment.mm, dtype=torch.uint8, count=offset) if offset else torch.empty(0, dtype=torch.uint8)
        for spec, value in zip(specs, values, strict=True):
            if spec.nbytes:
                out[spec.offset:spec.offset + spec.nbytes].copy_(value.view(-1).view(torch.uint8))
        del out
        return StagedBucket(0, segment, specs)


def restore(copy: HostCopy, manifest: wire.Manifest, step: Callable[..., list[RankReport]],
            router_options: dict[str, bool]) -> tuple[str, str] | None:
    """Reload the host copy of every tensor of ``manifest`` (the failed update) through ``step``, the engine's
    lifecycle call on its ranks (``step("wb_begin", names, options)`` ... one report per rank): begin, load,
    finish, or abort if a step failed. None when restored, else the failure (kind value, reason)."""
    bucket = copy.bucket(manifest)
    try:
        return reload_buckets([bucket], step, router_options)
    finally:
        bucket.segment.close()


def reload_buckets(buckets: list[StagedBucket], step: Callable[..., list[RankReport]],
                   router_options: dict[str, bool]) -> tuple[str, str] | None:
    """Load ``buckets`` (full tensors of a version the engine served) as one update through ``step``: begin with
    every tensor they hold, load each, finish, or abort if a step failed. None when done, else the failure
    (kind value, reason)."""
    reports = step("wb_begin", [s.name for b in buckets for s in b.specs], router_options)
    for bucket in buckets:
        if not all(r.ok for r in reports):
            break
        reports += step("wb_load", bucket.payload())
    reports += step("wb_finish" if all(r.ok for r in reports) else "wb_abort")
    failed = first_failure(reports)
    return None if failed is None else (failed[0].value, failed[1])
