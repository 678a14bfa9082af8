"""The trainer's LoRA (apps/lora.py) without an engine: a fresh adapter leaves the policy unchanged, only the
adapter trains, its tensors are named and shaped as the engine admits them (inference_side/lora.py's own check
against the checkpoint), the merged weights give the LoRA model's outputs; and the GRPO example's LoRA pieces
(engine options, the trainer-side parity check of an adapter sync, the job's ``--lora`` option)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apps.lora import (
    DEFAULT_TARGETS,
    LoRASettings,
    adapter_spec,
    adapter_tensors,
    add_lora,
    merged_tensors,
    nbytes,
)
from bridge import wire
from bridge.errors import ConfigError

TINY = {"hidden": 128, "inter": 256, "layers": 2}


def _policy(seed: int = 0) -> Any:
    from devtools.tiny_models import build_model

    return build_model("tiny", seed).float()


def _ids() -> Any:
    import torch

    return torch.tensor([[5, 70, 300, 9, 17, 400, 64, 2], [100, 101, 102, 103, 1, 2, 3, 4]])


def test_fresh_adapter_leaves_outputs_unchanged_and_only_it_trains() -> None:
    import torch

    policy = _policy()
    before = policy(input_ids=_ids()).logits
    paths = add_lora(policy, LoRASettings(8, 16.0))
    assert len(paths) == TINY["layers"] * len(DEFAULT_TARGETS)
    assert torch.equal(policy(input_ids=_ids()).logits, before)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    assert len(trainable) == 2 * len(paths)


def test_adapter_tensors_are_peft_named_and_shaped() -> None:
    policy = _policy()
    add_lora(policy, LoRASettings(8, 16.0))
    got = dict(adapter_tensors(policy))
    h, i = TINY["hidden"], TINY["inter"]
    assert tuple(got["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape) == (8, h)
    assert tuple(got["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape) == (h, 8)
    assert tuple(got["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape) == (8, i)
    assert tuple(got["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"].shape) == (i, 8)
    per_layer = 4 * (8 * h + h * 8) + 2 * (8 * h + i * 8) + (8 * i + h * 8)
    assert nbytes(list(got.items()), 2) == TINY["layers"] * per_layer * 2  # what the wire carries in bfloat16
    spec = adapter_spec(policy, "grpo")
    assert (spec.name, spec.rank, spec.alpha, spec.target_modules) == ("grpo", 8, 16.0, DEFAULT_TARGETS)


def test_engine_admits_the_adapter_against_the_checkpoint(tmp_path: Path) -> None:
    """The engine's own admission check (inference_side/lora.validate_adapter) on the manifest the publisher plans
    from ``adapter_tensors``, against the base checkpoint's tensor table."""
    from bridge.checkpoint import read_tensor_table
    from devtools.tiny_models import save_checkpoint
    from inference_side.lora import validate_adapter
    from trainer_side.packing import make_plan, plan_specs

    policy = _policy()
    table = read_tensor_table(save_checkpoint(policy, tmp_path / "v0"))
    add_lora(policy, LoRASettings(8, 16.0))
    plan, _ = make_plan(adapter_tensors(policy), "bfloat16", 64 << 20)
    manifest = wire.Manifest(version=1, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes,
                             adapter=adapter_spec(policy, "grpo"))
    assert validate_adapter(manifest, table, max_rank=8, served=None) is None


def test_merged_weights_give_the_lora_models_outputs() -> None:
    import torch

    policy = _policy()
    add_lora(policy, LoRASettings(4, 8.0, ("q_proj", "down_proj")))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.2 * torch.randn(param.shape))
    want = policy(input_ids=_ids()).logits
    plain = _policy()
    merged = dict(merged_tensors(policy))
    assert sorted(merged) == sorted(n for n, _ in plain.named_parameters())  # the checkpoint's names: a full update
    plain.load_state_dict(merged)
    got = plain(input_ids=_ids()).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(got, _policy()(input_ids=_ids()).logits, atol=1e-3)  # the adapter did change them


@pytest.mark.parametrize(("rank", "targets", "error"), [
    (0, DEFAULT_TARGETS, "LoRA rank must be at least 1"),
    (8, ("q_proj", "w_proj"), "LoRA target modules ['w_proj'] are not linear layers of the model"),
])
def test_add_lora_refuses_what_it_cannot_wrap(rank: int, targets: tuple[str, ...], error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        add_lora(_policy(), LoRASettings(rank, 2.0 * max(rank, 1), targets))


@pytest.mark.parametrize(("rank", "options"), [
    (0, {}),
    (1, {"enable_lora": True, "max_lora_rank": 1, "max_loras": 2}),
    (8, {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}),
    (12, {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2}),
])
def test_engine_options_make_room_for_the_rank(rank: int, options: dict[str, Any]) -> None:
    from apps.grpo_toy import GRPOConfig, engine_options

    assert engine_options(GRPOConfig(lora=rank)) == options


def _sync(*engines: str) -> dict[str, Any]:
    return {"ok": True, "verified": True, "probe_mean_abs_logprob_diff": None, "probe_flagged": False,
            "engines": [{"engine": e, "ok": True, "verified": True, "probe_mean_abs_logprob_diff": None,
                         "probe_flagged": False} for e in engines]}


@pytest.mark.parametrize(("checks", "passed"), [
    ([{"diff": 0.01, "ok": True, "adapter_versions": [3]}, {"diff": 0.02, "ok": True, "adapter_versions": [3]}], True),
    ([{"diff": 0.01, "ok": True, "adapter_versions": [3]}, {"diff": 0.09, "ok": True, "adapter_versions": [3]}], False),
    ([{"diff": 0.01, "ok": True, "adapter_versions": [3]}, {"diff": 0.0, "ok": False, "adapter_versions": [2]}], False),
])
def test_adapter_parity_is_the_syncs_probe(checks: list[dict[str, Any]], passed: bool) -> None:
    """An adapter sync passes only if every engine's outputs came from the version just published and their
    log-probs are within the bound of the trainer's."""
    from apps.grpo_toy import with_adapter_parity
    from apps.ray_job import sync_passed

    sync = with_adapter_parity(_sync("a", "b"), checks, bound=0.05)
    assert sync_passed(sync) is passed
    assert sync["probe_by"] == "trainer" and sync["adapter"] == "grpo"
    assert sync["probe_mean_abs_logprob_diff"] == max(c["diff"] for c in checks)
    assert [e["adapter_versions_served"] for e in sync["engines"]] == [c["adapter_versions"] for c in checks]


def test_job_takes_lora_for_grpo_only() -> None:
    from apps.ray_job import parse

    assert parse(["--loop", "grpo", "--lora", "8"]).lora == 8
    with pytest.raises(SystemExit):
        parse(["--loop", "versions", "--lora", "8"])
