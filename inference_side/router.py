"""Sink-aware routing: the common TP sink loader, sink discovery, checkpoint-name mapping.

vLLM's layerwise reload only updates a parameter that is written through its *current*
``weight_loader``. Models that write sinks with ``param.data.copy_`` lose the write during a
reload (the parameter is a meta placeholder then). Here every checkpoint-backed sink parameter
gets one common loader, and the router calls it directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge.errors import RouterError

logger = logging.getLogger(__name__)

SINK_SUFFIXES = ("sinks", "sink", "attn_sink", "attention_sink_bias")


def is_sink_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SINK_SUFFIXES


@dataclass(frozen=True)
class HeadRange:
    start: int
    count: int  # real heads held by this rank
    padded: int  # length of the runtime parameter (>= count)


def sink_head_range(global_heads: int, param_len: int, tp_rank: int, tp_size: int, name: str = "sinks") -> HeadRange:
    """Partition ``global_heads`` sink heads over TP ranks; the shard length comes from the checkpoint.

    The runtime parameter may be padded (``param_len > count``); the padding is set to -inf.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise RouterError(f"{name}: invalid tensor-parallel rank {tp_rank} of {tp_size}")
    if global_heads % tp_size:
        raise RouterError(f"{name}: {global_heads} sink heads do not divide evenly over tensor-parallel size {tp_size}")
    count = global_heads // tp_size
    if count > param_len:
        raise RouterError(
            f"{name}: rank {tp_rank} needs {count} sink heads but the runtime parameter holds only {param_len}"
        )
    return HeadRange(start=tp_rank * count, count=count, padded=param_len)


class SinkLoader:
    """The common TP sink loader: takes the *global* checkpoint sinks, writes this rank's shard.

    Registered as a parameter's ``weight_loader`` so that vLLM's layerwise reload wrapper sees and
    counts the write. Padded heads are written as -inf with ``copy_`` too, so the reload's element
    count is complete and the layer is processed as soon as its sinks arrive.
    """

    __name__ = "weight_bridge_sink_loader"

    def __init__(self, tp_rank: int, tp_size: int, name: str) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.name = name

    def __call__(self, param: Any, loaded_weight: Any) -> None:
        import torch

        if loaded_weight.ndim != 1:
            raise RouterError(f"{self.name}: sinks must be one-dimensional, got shape {list(loaded_weight.shape)}")
        rng = sink_head_range(int(loaded_weight.shape[0]), int(param.shape[0]), self.tp_rank, self.tp_size, self.name)
        shard = loaded_weight.narrow(0, rng.start, rng.count)
        param.data[: rng.count].copy_(shard)
        if rng.padded > rng.count:
            fill = torch.full((rng.padded - rng.count,), float("-inf"), dtype=param.dtype, device=shard.device)
            param.data[rng.count :].copy_(fill)


def probe_sink_layout(model: Any, ckpt_name: str, path: str, global_heads: int, dtype: Any) -> list[int | None]:
    """Run the model's own load code for one checkpoint sink tensor against a NaN-filled stand-in of the live
    parameter (same attributes, so the same loader); return, per parameter slot, the global head index the
    model writes there (``None``: not written, i.e. padding). The live parameter is never touched."""
    import torch

    module_path, _, pname = path.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    live = module._parameters[pname]
    scratch = torch.nn.Parameter(torch.full_like(live.data, float("nan")), requires_grad=False)
    scratch.__dict__.update(live.__dict__)
    probe = torch.arange(global_heads, dtype=torch.float32).to(dtype)
    module._parameters[pname] = scratch
    try:
        model.load_weights([(ckpt_name, probe)])
    finally:
        module._parameters[pname] = live
    return [None if v != v else int(v) for v in scratch.data.float().tolist()]


def layout_matches(layout: list[int | None], rng: HeadRange) -> bool:
    """Does the model's own write (``probe_sink_layout``) put this rank's head range first, padding after?"""
    return layout == list(range(rng.start, rng.start + rng.count)) + [None] * (rng.padded - rng.count)


def init_sink_padding(param: Any, global_heads: int, tp_rank: int, tp_size: int, name: str) -> HeadRange:
    """At engine start: set padded heads of a live sink parameter to -inf; return its head range."""
    rng = sink_head_range(global_heads, int(param.shape[0]), tp_rank, tp_size, name)
    if rng.padded > rng.count:
        param.data[rng.count :].fill_(float("-inf"))
    return rng


class RoutedLoader:
    """Wraps a parameter's own loader. A call marked ``wb_routed=True`` copies an already-local tensor
    (captured from the model's own direct-copy code); any other call goes to the original loader, so
    the model's quantization dispatch is left untouched."""

    __name__ = "weight_bridge_routed_loader"

    def __init__(self, original: Callable[..., Any] | None) -> None:
        self.original = original

    def __call__(self, param: Any, loaded_weight: Any, *args: Any, wb_routed: bool = False, **kwargs: Any) -> Any:
        if wb_routed:
            param.data.copy_(loaded_weight)
            return None
        if self.original is None:
            param.data.copy_(loaded_weight)
            return None
        return self.original(param, loaded_weight, *args, **kwargs)


def map_checkpoint_name(model: Any, name: str) -> str | None:
    """Checkpoint name -> vLLM parameter name through the model's ``hf_to_vllm_mapper`` (if any)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return name
    mapped = mapper._map_name_with_shard(name) if hasattr(mapper, "_map_name_with_shard") else (mapper._map_name(name), None)
    if mapped is None or mapped[0] is None:
        return None
    return str(mapped[0])


def owning_module_path(module_names: set[str], param_path: str) -> str:
    """The deepest module path that is a prefix of ``param_path`` ('' for the root)."""
    parts = param_path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in module_names:
            return candidate
    return ""
