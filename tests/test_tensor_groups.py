"""tensor_group: parameter paths of Qwen2 and GPT-OSS (the names of devtools/tiny_models.py) and a few other
conventions, mapped to the groups the delta telemetry reports per group."""

from __future__ import annotations

import pytest

from bridge.tensor_groups import GROUPS, tensor_group


@pytest.mark.parametrize(("name", "group"), [
    # Qwen2 (and Llama-style names)
    ("model.embed_tokens.weight", "embed"),
    ("model.layers.0.self_attn.q_proj.weight", "attn"),
    ("model.layers.11.self_attn.k_proj.bias", "attn"),
    ("model.layers.3.self_attn.o_proj.weight", "attn"),
    ("model.layers.0.mlp.gate_proj.weight", "mlp"),
    ("model.layers.27.mlp.down_proj.weight", "mlp"),
    ("model.layers.0.input_layernorm.weight", "norm"),
    ("model.layers.0.post_attention_layernorm.weight", "norm"),
    ("model.layers.0.self_attn.q_norm.weight", "norm"),
    ("model.norm.weight", "norm"),
    ("lm_head.weight", "lm_head"),
    # GPT-OSS
    ("model.layers.0.self_attn.sinks", "sinks"),
    ("model.layers.1.mlp.router.weight", "router"),
    ("model.layers.1.mlp.router.bias", "router"),
    ("model.layers.1.mlp.experts.gate_up_proj", "experts"),
    ("model.layers.1.mlp.experts.gate_up_proj_bias", "experts"),
    ("model.layers.1.mlp.experts.down_proj", "experts"),
    # Qwen2-MoE: the router is ``mlp.gate``, the shared expert an expert
    ("model.layers.2.mlp.gate.weight", "router"),
    ("model.layers.2.mlp.experts.7.up_proj.weight", "experts"),
    ("model.layers.2.mlp.shared_expert.up_proj.weight", "experts"),
    # GPT-2 style and unknown names
    ("transformer.wte.weight", "embed"),
    ("transformer.h.3.attn.c_attn.weight", "attn"),
    ("transformer.h.3.ln_1.weight", "norm"),
    ("transformer.h.3.mlp.c_fc.weight", "mlp"),
    ("transformer.ln_f.weight", "norm"),
    ("model.layers.0.some_adapter.scale", "other"),
    ("rotary.inv_freq", "other"),
])
def test_tensor_group(name: str, group: str) -> None:
    assert tensor_group(name) == group
    assert group in GROUPS


def test_layer_number_and_prefix_do_not_change_the_group() -> None:
    names = ("self_attn.v_proj.weight", "mlp.up_proj.weight", "mlp.experts.down_proj", "self_attn.sinks")
    for local in names:
        groups = {tensor_group(f"{prefix}layers.{n}.{local}") for prefix in ("", "model.", "model.language_model.") for n in (0, 7, 95)}
        assert len(groups) == 1, (local, groups)
