"""Tensor groups: which part of a transformer a parameter belongs to, for telemetry per group (the delta
updates' density per group in records, ``/metrics`` and the dashboard). Pure: names only."""

from __future__ import annotations

import re

GROUPS = ("embed", "attn", "mlp", "experts", "router", "norm", "sinks", "lm_head", "other")
_LAYER_PREFIX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.\d+\.")
_ATTN = frozenset({"self_attn", "attn", "attention", "self_attention", "cross_attn"})
_MLP = frozenset({"mlp", "ffn", "feed_forward", "feedforward"})
_ROUTER = frozenset({"router", "gate"})  # a MoE's router: GPT-OSS ``mlp.router``, Qwen2-MoE ``mlp.gate`` (not ``gate_proj``)


def tensor_group(name: str) -> str:
    """The group of parameter ``name`` (one of ``GROUPS``): the path after ``layers.N.`` (or ``h.N.``,
    ``blocks.N.``) is matched part by part, so ``model.layers.3.self_attn.q_proj.weight`` is ``attn``,
    ``model.layers.3.mlp.experts.gate_up_proj`` ``experts``, ``model.layers.3.self_attn.sinks`` ``sinks``,
    every norm ``norm`` (``q_norm`` included), ``model.embed_tokens.weight`` ``embed``; anything unknown is
    ``other``."""
    local = _LAYER_PREFIX.split(name.lower())[-1]
    parts = local.split(".")
    if parts[-1] == "sinks":
        return "sinks"
    if "experts" in parts or "shared_expert" in parts or "shared_experts" in parts:
        return "experts"
    if any(p in _ROUTER for p in parts):
        return "router"
    if any("norm" in p or p.startswith("ln_") or p in ("ln", "ln_f") for p in parts):
        return "norm"
    if any(p in _ATTN for p in parts):
        return "attn"
    if any(p in _MLP for p in parts):
        return "mlp"
    if any("embed" in p or p in ("wte", "wpe") for p in parts):
        return "embed"
    if "lm_head" in parts or parts[0] == "output":
        return "lm_head"
    return "other"
