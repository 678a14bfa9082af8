"""On tiny GPT-OSS, sinks and fused experts really update on every sync, at TP 1 and 2, in
bfloat16 and float16 -- and with the router switched off the audit catches the stale tensors.

Three of the four TP x dtype pairs: TP 2 (each rank's slice of the sinks) in bfloat16, where the backend's sinks
alias the parameter, and float16 (a converted copy the backend must refresh) at TP 1. Each rank refreshes its
own slice by the same code whatever the TP size, so float16 at TP 2 adds an engine start (about 110 s) and
no path the others do not run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, generate, oracle, run_trainer

pytestmark = pytest.mark.engine

SINKS = ["model.layers.0.attn.sinks", "model.layers.1.attn.sinks"]
CKPT_SINKS = ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]


@pytest.fixture(scope="module", params=[(1, "bfloat16"), (2, "bfloat16"), (1, "float16")],
                ids=["tp1-bf16", "tp2-bf16", "tp1-fp16"])
def gpt_oss(request: Any, ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    tp, dtype = request.param
    actor = InferenceActor.remote(model=str(checkpoints("gpt_oss", 1)), tensor_parallel_size=tp, dtype=dtype)
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield {"actor": actor, "tp": tp, "dtype": dtype}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def _expected_shards(ckpt: Path, dtype: str, tp: int) -> list[dict[str, list[float]]]:
    import torch
    from safetensors.torch import load_file

    state = load_file(str(ckpt / "model.safetensors"))
    out = []
    for rank in range(tp):
        shard = {}
        for path, name in zip(SINKS, CKPT_SINKS, strict=True):
            full = state[name].to(getattr(torch, dtype))
            per = full.shape[0] // tp
            shard[path] = full[rank * per:(rank + 1) * per].float().tolist()
        out.append(shard)
    return out


def test_two_syncs_update_sinks_and_experts(gpt_oss: Any, tmp_path: Any) -> None:
    import ray

    actor, tp, dtype = gpt_oss["actor"], gpt_oss["tp"], gpt_oss["dtype"]
    endpoint = ray.get(actor.endpoint.remote())
    served: dict[Path, list[dict[str, Any]]] = {}  # each version's outputs, against its cold load at the end
    for version, seed in ((2, 2), (3, 3)):
        (line,) = run_trainer(endpoint, "gpt_oss", seeds=[seed], first_version=version, save_dir=tmp_path)
        assert line["ok"], line
        (eng,) = line["engines"]
        assert eng["verified"] and not eng["stale"] and not eng["identity"], eng
        assert eng["routed_sinks"] == 2, eng
        assert eng["routed_bypass"] == 8, eng  # gate_up/down weights and biases of 2 layers
        ckpt = tmp_path / f"v{version}"
        served[ckpt] = generate(actor)
        live = ray.get(actor.read_params.remote(SINKS))
        assert live == _expected_shards(ckpt, dtype, tp)
        backend = ray.get(actor.backend_sinks.remote())
        for rank in range(tp):
            for path in SINKS:
                entry = backend[rank][path]
                assert entry["values"] == live[rank][path], f"rank {rank} {path}: kernel reads stale sinks"
                if dtype == "bfloat16":
                    assert entry["aliased"], "bf16 backend sinks must alias the parameter"
    for outputs, cold in zip(served.values(), oracle(list(served), tp, dtype), strict=True):  # one cold-load process
        assert_same_outputs(outputs, cold)
    records = ray.get(actor.records.remote())
    assert [r["version"] for r in records if r["ok"]] == [2, 3]
    assert all(r["identity_violations"] == [] for r in records)


def test_router_off_audit_names_stale_tensors(ray_session: Any, checkpoints: Any) -> None:
    """The audit catches the bug it exists for: without the router, sinks and experts stay stale."""
    import ray

    from inference_side import InferenceActor

    actor = InferenceActor.remote(model=str(checkpoints("gpt_oss", 1)), tensor_parallel_size=1, dtype="bfloat16",
                                  config={"router": {"enabled": False}})
    try:
        endpoint = ray.get(actor.endpoint.remote(), timeout=600)
        (line,) = run_trainer(endpoint, "gpt_oss", seeds=[2], first_version=2)
        assert not line["ok"]
        for name in ("model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks",
                     "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            assert f"{name}: sent but never written through a weight loader (stale)" in line["error"], line["error"]
        assert ray.get(actor.version.remote()) == 0
        with pytest.raises(ray.exceptions.RayTaskError, match="degraded"):
            generate(actor)
    finally:
        ray.kill(actor)
