"""Read-back of the LoRA weights one TP worker serves for an adapter version, against the trainer's.

After vLLM registered an adapter version (``add_lora``: it loads the PEFT directory, packs modules, scales B and
activates it in a slot of every LoRA layer), each worker reads its own LoRA layers' stacked weights for that
version's slot (``lora_a_stacked[i][slot, 0]`` ``[max_rank, in]``, ``lora_b_stacked[i][slot, 0]`` ``[out, max_rank]``)
and compares them with the verified tensors the trainer sent, put through the same transforms computed here, apart
from vLLM's code: the cast to the LoRA dtype, B times the adapter's scaling (``lora_alpha / r``, ``/ sqrt(r)`` with
rsLoRA) in that dtype as ``LoRALayerWeights.optimize`` does, the packed layers' slices (``qkv_proj`` holds
``q_proj``, ``k_proj``, ``v_proj`` in slices 0, 1, 2; a module the adapter leaves out must read zero) and this TP
rank's shard (column-parallel layers: B's rows of this rank's shard of that slice; row-parallel: A's columns). Each
transform is exact, so the comparison is bit for bit, and the padding beyond rank ``r`` must be zero. It also
checks that the base weights did not move: every parameter and buffer keeps its storage, and those whose bytes are
readable (on CPU vLLM repacks linear weights into opaque buffers: their parameters read empty) keep their checksum.

Layers other than the plain linear LoRA layers (fully sharded LoRA, MoE, embeddings, logits) are reported as not
read back, which fails the check: the engine cannot show that it serves the trainer's weights there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from bridge.report import FailureKind, RankReport
from inference_side.audit import StorageKey, storage_key
from inference_side.lora import PEFT_PREFIX

Fingerprint = dict[str, tuple[StorageKey, int | None]]
_MAX_LINES = 8  # mismatches named per rank (the count is complete)


def adapter_scaling(config: Mapping[str, Any]) -> float:
    """The factor PEFT (and vLLM) apply to B: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", 8))  # PEFT's default
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def shard(kind: str, a: Any, b: Any, tp_rank: int, in_part: int, out_part: int, shard_id: int) -> tuple[Any, Any]:
    """This TP rank's part of one PEFT module's A ``[r, in]`` and B ``[out, r]`` in a LoRA layer of ``kind``:
    ``replicated`` (both whole), ``column`` (B's rows ``shard_id * out_part`` on; the slice's own shard for packed
    layers, whose ranks may share KV heads), ``row`` (A's columns ``tp_rank * in_part`` on)."""
    if kind == "replicated":
        return a, b
    if kind == "column":
        return a, b[shard_id * out_part:(shard_id + 1) * out_part]
    if kind == "row":
        return a[:, tp_rank * in_part:(tp_rank + 1) * in_part], b
    raise ValueError(f"no LoRA layer kind {kind!r}")


def _layer_kind(layer: Any) -> str | None:
    from vllm.lora.layers import (
        ColumnParallelLinearWithLoRA,
        MergedColumnParallelLinearWithLoRA,
        MergedQKVParallelLinearWithLoRA,
        ReplicatedLinearWithLoRA,
        RowParallelLinearWithLoRA,
    )

    cls = type(layer)
    if cls is ReplicatedLinearWithLoRA:
        return "replicated"
    if cls is RowParallelLinearWithLoRA:
        return "row"
    if cls in (MergedColumnParallelLinearWithLoRA, MergedQKVParallelLinearWithLoRA):
        return "column"
    if cls is ColumnParallelLinearWithLoRA and not layer.is_merged_col_linear:
        return "column"
    return None


def fingerprint(model: Any) -> Fingerprint:
    """Storage and (where the bytes are readable) checksum of every parameter and buffer of ``model``."""
    import zlib

    out: Fingerprint = {}
    for prefix, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            key = storage_key(t)
            crc = None
            if t.numel() > 0 and t.data_ptr() != 0 and not t.is_meta:
                crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(_byte_dtype()).numpy())
            out[f"{prefix}:{name}"] = (key, crc)
    return out


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def base_moved(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Every parameter or buffer of ``before`` whose storage or checksum is not the same in ``after``."""
    moved = []
    for name, (key, crc) in before.items():
        now = after.get(name)
        if now is None:
            moved.append(f"{name}: gone")
        elif now[0] != key:
            moved.append(f"{name}: storage {key} -> {now[0]}")
        elif now[1] != crc:
            moved.append(f"{name}: checksum {crc} -> {now[1]}")
    return moved


def read_back(manager: Any, lora_id: int, tensors: Mapping[str, Any], config: Mapping[str, Any],
              tp_rank: int) -> dict[str, Any]:
    """Compare the slot of LoRA id ``lora_id`` in every LoRA layer of ``manager`` (vLLM's ``LoRAModelManager``)
    with ``tensors`` (the adapter's PEFT tensors, as verified) and ``config`` (its PEFT config). Returns this
    rank's report: ``slot``, ``modules`` (PEFT modules compared), ``slices`` (layer slices compared, those the
    adapter leaves out included), ``bytes`` and ``mismatches`` (one line each, at most a few; ``mismatch_count``
    counts them all)."""
    import torch

    t0 = time.perf_counter()
    report: dict[str, Any] = {"rank": tp_rank, "lora_id": lora_id, "slot": None, "modules": 0, "slices": 0,
                              "bytes": 0, "mismatches": [], "mismatch_count": 0}
    bad: list[str] = []
    try:
        slot = manager.lora_index_to_id.index(lora_id)
    except ValueError:
        bad.append(f"LoRA id {lora_id} is not active in any slot (slots hold {list(manager.lora_index_to_id)})")
        slot = None
    report["slot"] = slot
    modules: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        module, _, ab = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        modules.setdefault(module, {})[ab.removesuffix(".weight")] = t
    rank, scaling = int(config["r"]), adapter_scaling(config)
    seen: set[str] = set()
    for layer_name, layer in (manager.modules.items() if slot is not None else ()):
        parent, _, leaf = layer_name.rpartition(".")
        members = list(manager.packed_modules_mapping.get(leaf, [leaf]))
        if not hasattr(layer, "lora_a_stacked"):
            continue
        n_slices = len(layer.lora_a_stacked)
        if n_slices != len(members):
            members = [leaf] if n_slices == 1 else [f"slice_{i}" for i in range(n_slices)]
        kind = _layer_kind(layer)
        for i, member in enumerate(members):
            path = f"{parent}.{member}" if parent else member
            got_a, got_b = layer.lora_a_stacked[i][slot, 0], layer.lora_b_stacked[i][slot, 0]
            mine = modules.get(path)
            report["slices"] += 1
            if mine is None:  # not adapted: vLLM zeroes the slot's slice
                if got_a.count_nonzero() or got_b.count_nonzero():
                    bad.append(f"{path} (slice {i} of {layer_name}): the adapter has no such module, the slot is not zero")
                continue
            seen.add(path)
            if kind is None:
                bad.append(f"{path}: LoRA layer {type(layer).__name__} ({layer_name}) is not read back by this check")
                continue
            a = mine["A"].to(got_a.dtype)
            b = mine["B"].to(got_b.dtype).clone()
            if scaling != 1:
                b *= scaling  # as vLLM's LoRALayerWeights.optimize, in the LoRA dtype
            out_part = got_b.shape[0]
            shard_id = layer.output_ids[i] if hasattr(layer, "output_ids") else tp_rank
            a, b = shard(kind, a, b, tp_rank, got_a.shape[1], out_part, shard_id)
            report["modules"] += 1
            report["bytes"] += a.numel() * a.element_size() + b.numel() * b.element_size()
            for which, want, got, pad in (("A", a, got_a[:rank], got_a[rank:]), ("B", b, got_b[:, :rank], got_b[:, rank:])):
                if tuple(want.shape) != tuple(got.shape):
                    bad.append(f"{path}.lora_{which}: the engine holds {list(got.shape)}, expected {list(want.shape)}")
                elif not torch.equal(want, got):
                    diff = (want.float() - got.float()).abs()
                    bad.append(f"{path}.lora_{which}: {int((diff != 0).sum())} of {want.numel()} values differ from "
                               f"the trainer's (max |diff| {float(diff.max()):.3g}) in {layer_name} slice {i}, slot {slot}")
                if pad.count_nonzero():
                    bad.append(f"{path}.lora_{which}: the slot's padding beyond rank {rank} is not zero")
    if slot is not None:
        for path in sorted(set(modules) - seen):
            bad.append(f"{path}: no LoRA layer of the engine holds this module")
    report["mismatch_count"] = len(bad)
    report["mismatches"] = bad[:_MAX_LINES]
    report["seconds"] = time.perf_counter() - t0
    return report


def readback_rank(report: Mapping[str, Any]) -> RankReport:
    """One rank's read-back (``WeightSyncWorker.wb_lora_readback``) as the rank's report of the update: failed with
    kind ``stale`` when its LoRA weights are not the trainer's, ``identity`` when a base weight moved."""
    rank = int(report.get("rank", 0))
    mismatches = tuple(report.get("mismatches") or ())
    moved = tuple(report.get("base_moved") or ())
    seconds = {"verify": float(report.get("seconds", 0.0))}
    common: dict[str, Any] = {"tensors": 2 * int(report.get("modules", 0)), "stale": mismatches, "identity_violations": moved,
              "seconds": seconds}
    if mismatches:
        count = int(report.get("mismatch_count", len(mismatches)))
        return RankReport(rank, ok=False, kind=FailureKind.STALE, error=f"LoRA read-back on TP rank {rank}: {count} "
                          f"mismatch(es) with the trainer's adapter: {'; '.join(mismatches[:3])}", **common)
    if moved:
        count = int(report.get("base_moved_count", len(moved)))
        return RankReport(rank, ok=False, kind=FailureKind.IDENTITY, error=f"LoRA read-back on TP rank {rank}: "
                          f"{count} base weight(s) moved while the adapter was registered: {'; '.join(moved[:3])}",
                          **common)
    return RankReport(rank, **common)


def readback_summary(reports: list[Mapping[str, Any]]) -> dict[str, Any]:
    """What the update's report carries of the read-back: ``ok`` and each rank's report."""
    ok = all(not r.get("mismatches") and not r.get("base_moved") for r in reports)
    return {"ok": ok, "ranks": [dict(r) for r in reports]}


def pack_tensors(tensors: Mapping[str, Any]) -> dict[str, tuple[str, list[int], bytes]]:
    """The adapter's tensors as ``(dtype, shape, bytes)``, for ``collective_rpc`` (its serializer does not carry
    torch tensors as such); ``unpack_tensors`` turns them back, bit for bit."""
    import torch

    return {name: (str(t.dtype).removeprefix("torch."), list(t.shape),
                   t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for name, t in tensors.items()}


def unpack_tensors(packed: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    out = {}
    for name, (dtype, shape, raw) in packed.items():
        out[name] = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(tuple(shape))
    return out
