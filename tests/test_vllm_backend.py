"""weight-bridge as vLLM's own weight-transfer backend ``weight_bridge``: registered through vLLM's plugin
entry point, created by vLLM in every worker of an ``LLM(..., weight_transfer_config=...)`` held by a Ray
actor, driven from the trainer by vLLM's ``WeightTransferTrainerFactory`` with ``RayVLLMWeightSyncClient`` and
``ModuleSource``. After each update the engine equals an engine cold-loaded from the same weights; a refused
update fails vLLM's call with its kind and reason and the engine keeps its version; with the sink router off
the tiny GPT-OSS engine does not equal the cold load (the stale sinks the router exists for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import PROMPTS, ROOT, assert_same_outputs, child_env, oracle

BASE_PORT = 27410


def test_backend_is_registered_through_the_entry_point_in_a_fresh_process() -> None:
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as E, "
            "WeightTransferTrainerFactory as T; print('weight_bridge' in E._registry, 'weight_bridge' in T._registry)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd="/", timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "True True", out.stderr[-2000:]


def _generate(llm: Any) -> list[dict[str, Any]]:
    import ray
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, detokenize=False)
    outs = ray.get(llm.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
    return [{"token_ids": list(o.outputs[0].token_ids),
             "logprobs": [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)]}
            for o in outs]


def _llm(ray_session: Any, model: Path, port: int) -> Any:
    from vllm import LLM

    env = {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    actor = ray_session.remote(num_cpus=0)(LLM).options(runtime_env={"env_vars": env}).remote(
        model=str(model), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
        enforce_eager=True, weight_transfer_config={"backend": "weight_bridge"})
    return actor


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["tiny", "gpt_oss"])
def test_updates_through_vllms_api_equal_a_cold_load(ray_session: Any, checkpoints: Any, tmp_path: Path, kind: str) -> None:
    import ray
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge.errors import UpdateFailed
    from bridge.report import FailureKind
    from devtools.tiny_models import build_model, save_checkpoint
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    port = BASE_PORT + (0 if kind == "tiny" else 10)
    llm = _llm(ray_session, checkpoints(kind, 1), port)
    try:
        client = RayVLLMWeightSyncClient(llm)
        model = build_model(kind, seed=2)
        trainer = WeightTransferTrainerFactory.trainer_init(
            WeightBridgeInitInfo(rank=0, base_port=port), client=client, source=ModuleSource(model))
        seen = []
        for seed, version in ((2, 1), (3, 2)):
            if seed != 2:
                model = build_model(kind, seed=seed)
                trainer.source = ModuleSource(model)
            trainer.send_weights()
            assert trainer.version == version and trainer.last_report is not None and trainer.last_report.ok
            assert ray.get(llm.get_weight_version.remote()) == str(version)
            seen.append((_generate(llm), save_checkpoint(model, tmp_path / f"{kind}-v{version}")))
        cold = oracle([ckpt for _, ckpt in seen], 1, "bfloat16")
        for (got, _), want in zip(seen, cold, strict=True):
            assert_same_outputs(got, want)
        assert seen[0][0] != seen[1][0]
        # a refused update: an older version fails vLLM's call with its kind; the engine keeps version 2
        with pytest.raises(UpdateFailed) as info:
            trainer.send_weights(version=1)
        assert FailureKind.VERSION in info.value.kinds.values(), (info.value.kinds, str(info.value))
        assert_same_outputs(_generate(llm), cold[1])
        trainer.shutdown()
    finally:
        ray.kill(llm)
