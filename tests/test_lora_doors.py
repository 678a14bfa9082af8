"""LoRA adapters as versions through two more doors, against the same oracle as tests/test_lora.py (a plain vLLM
engine loading the PEFT directories itself, run once for the module): an ``LLM(...,
weight_transfer_config={"backend": "weight_bridge"})`` engine in a Ray actor that takes adapter versions from vLLM's
trainer-side API (``RayVLLMWeightSyncClient``, ``WeightBridgeTrainerEngine.send_adapter``) and serves them through a
``LoRARequest`` on the directory it verified; and the InferenceActor in streaming mode (``sync.mode: streaming``),
where an adapter version is still atomic: requests run on the served version while the new one streams in, and a
version that fails in its last bucket never serves."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from bridge import wire
from tests.helpers import PROMPTS, ROOT, assert_same_outputs, lora_oracle
from tests.rawclient import RawClient
from tests.test_lora import MAX_RANK, NAME, PREFIX, adapter_spec, adapter_tensors, gen, peft_dir, publish

pytestmark = pytest.mark.engine
BASE_PORT = 26310  # the LLM engine's receiver (TP rank 0)


@pytest.fixture(scope="module")
def oracle(checkpoints: Any, tmp_path_factory: Any) -> Any:
    """The adapter's versions (seeds 11 and 12, as in tests/test_lora.py), their PEFT directories and what a
    plain vLLM engine gives under each, and without one."""
    base, spec = checkpoints("tiny", 1), adapter_spec()
    tensors = {1: adapter_tensors(11), 2: adapter_tensors(12)}
    root = tmp_path_factory.mktemp("lora-doors")
    dirs = {v: peft_dir(root / f"v{v}", t, spec) for v, t in tensors.items()}
    cold = lora_oracle(base, list(dirs.values()), 1, "bfloat16", max_lora_rank=MAX_RANK, max_loras=2)
    return {"base": base, "spec": spec, "tensors": tensors, "want": {v: cold[str(d)] for v, d in dirs.items()},
            "cold_base": cold["base"]}


# ---- the LLM door ---------------------------------------------------------------------------------------

def _llm_generate(llm: Any, lora: Any = None) -> list[dict[str, Any]]:
    import ray
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, detokenize=False)
    outs = ray.get(llm.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                                       lora_request=lora), timeout=600)
    return [{"token_ids": list(o.outputs[0].token_ids),
             "logprobs": [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)]}
            for o in outs]


def test_llm_door_serves_two_adapter_versions_like_vllm_loading_the_peft_directory(ray_session: Any, oracle: Any) -> None:
    """Two adapter versions sent with ``send_adapter`` to an ``LLM`` engine: each answer names the directory the
    engine's worker verified, a ``LoRARequest`` on it gives the oracle's tokens and logprobs, the base outputs and
    the base version label do not move."""
    import ray
    from vllm import LLM
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.lora.request import LoRARequest

    from trainer_side.vllm_backend import WeightBridgeInitInfo

    env = {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    llm = ray_session.remote(num_cpus=0)(LLM).options(runtime_env={"env_vars": env}).remote(
        model=str(oracle["base"]), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
        enforce_eager=True, enable_lora=True, max_lora_rank=MAX_RANK, max_loras=2,
        weight_transfer_config={"backend": "weight_bridge"})
    try:
        label = ray.get(llm.get_weight_version.remote(), timeout=900)
        base_before = _llm_generate(llm)
        trainer = WeightTransferTrainerFactory.trainer_init(WeightBridgeInitInfo(rank=0, base_port=BASE_PORT),
                                                            client=RayVLLMWeightSyncClient(llm), source=None)
        try:
            for version in (1, 2):
                answer = trainer.send_adapter(oracle["tensors"][version], oracle["spec"])
                assert (answer["name"], answer["version"]) == (NAME, version) and answer["path"], answer
                assert trainer.last_report is not None and trainer.last_report.ok
                lora = LoRARequest(f"{NAME}@v{version}", version, answer["path"])
                assert_same_outputs(_llm_generate(llm, lora), oracle["want"][version])
        finally:
            trainer.shutdown()
        assert ray.get(llm.get_weight_version.remote()) == label  # adapters leave the base's label alone
        after = _llm_generate(llm)
        assert after == base_before
        assert_same_outputs(after, oracle["cold_base"])
    finally:
        ray_session.kill(llm)


# ---- streaming mode on the actor door ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def streaming(ray_session: Any, oracle: Any) -> Any:
    from inference_side import InferenceActor

    actor = InferenceActor.remote(model=str(oracle["base"]), tensor_parallel_size=1, dtype="bfloat16",
                                  config={"sync": {"mode": "streaming"}, "deadlines": {"bucket_s": 600.0}},
                                  enable_lora=True, max_lora_rank=MAX_RANK,
                                  max_loras=2)
    endpoint = ray_session.get(actor.endpoint.remote(), timeout=900)
    yield {"actor": actor, "endpoint": endpoint}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def _two_bucket_adapter(tensors: dict[str, Any], version: int, flip_last: bool = False) -> tuple[wire.Manifest, list[tuple[wire.BucketHeader, bytes]]]:
    """``tensors`` as an adapter update in two buckets (layer 0's modules, then layer 1's), as a raw publisher
    sends it; ``flip_last``: the last bucket's first checksum is off by one bit."""
    import torch

    specs, buckets = [], []
    for index, layer in enumerate((0, 1)):
        names = [n for n in tensors if n.startswith(PREFIX.format(layer=layer, module=""))]
        raws = [tensors[n].contiguous().view(torch.uint8).numpy().tobytes() for n in names]
        offset = 0
        for name, raw in zip(names, raws, strict=True):
            specs.append(wire.TensorSpec(name, "bfloat16", tuple(tensors[name].shape), index, offset, len(raw)))
            offset += len(raw)
        sums = [zlib.crc32(r) for r in raws]
        if flip_last and index == 1:
            sums[0] ^= 1
        buckets.append((wire.BucketHeader(version=version, index=index, checksums=tuple(sums)), b"".join(raws)))
    manifest = wire.Manifest(version=version, bucket_sizes=tuple(len(p) for _, p in buckets), tensors=tuple(specs),
                             adapter=adapter_spec())
    return manifest, buckets


def test_streaming_adapter_versions_match_the_oracle(streaming: Any, oracle: Any) -> None:
    import ray

    actor, endpoint = streaming["actor"], streaming["endpoint"]
    for version in (1, 2):
        report = publish(endpoint, oracle["tensors"][version], version)
        (engine,) = report.engines
        assert report.ok and engine.ok and engine.engine["lora_readback"]["ok"], engine
        assert ray.get(actor.adapter_version.remote(NAME)) == version
        assert_same_outputs(gen(actor, NAME), oracle["want"][version])
    assert [r["ok"] for r in ray.get(actor.records.remote()) if r["adapter"] == NAME] == [True, True]


def test_streaming_adapter_update_is_atomic(streaming: Any, oracle: Any) -> None:
    """Mid-stream (the first bucket loaded, the second not sent) requests run on the served version, exactly; a
    version whose last bucket fails its checksum never serves; a whole one serves once verified. (The raw publisher
    sends no heartbeats: the engine waits up to ``deadlines.bucket_s`` for the second bucket, long for a loaded box.)"""
    import ray

    actor, endpoint = streaming["actor"], streaming["endpoint"]
    served = ray.get(actor.adapter_version.remote(NAME))
    assert served == 2, "runs after test_streaming_adapter_versions_match_the_oracle"
    for version, flip in ((3, True), (3, False)):  # v1's weights as version 3: the oracle knows them
        manifest, buckets = _two_bucket_adapter(oracle["tensors"][1], version, flip_last=flip)
        client = RawClient(endpoint, identity=f"streaming-adapter-{flip}".encode())
        try:
            client.send(wire.Begin(manifest))
            client.until(wire.Credit)
            client.send(*buckets[0])
            client.until(wire.Credit, timeout=120)  # bucket 0 verified and handed to the engine
            middle = gen(actor, NAME)
            assert all(o["adapter_version"] == served for o in middle)
            assert_same_outputs(middle, oracle["want"][2])
            client.send(*buckets[1])
            client.send(wire.End(version=version))
            ack: wire.Ack = client.until(wire.Ack, timeout=300)
        finally:
            client.close()
        if flip:
            assert not ack.ok and "checksum mismatch" in ack.reason, ack.reason
            assert ray.get(actor.adapter_version.remote(NAME)) == served
            assert_same_outputs(gen(actor, NAME), oracle["want"][2])
        else:
            assert ack.ok, ack.reason
            assert ray.get(actor.adapter_version.remote(NAME)) == 3
            assert_same_outputs(gen(actor, NAME), oracle["want"][1])
