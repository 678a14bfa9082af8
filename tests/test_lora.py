"""LoRA adapters as versions (issue 23, first slice): an engine started with LoRA enabled takes adapter
versions over the bridge and then generates exactly as a plain vLLM engine that loads the same PEFT
directory itself; its base outputs stay as they were; bad adapters are refused with their reason and the
previous adapter version keeps serving."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from bridge import wire
from tests.fault_worker import FAULT_WORKER
from tests.helpers import PROMPTS, assert_same_outputs, lora_oracle
from tests.rawclient import RawClient

pytestmark = pytest.mark.engine

MAX_RANK = 8
NAME = "math"
TARGETS = ("q_proj", "v_proj")
LAYERS = 2  # the tiny dense model: hidden 128, 2 layers, q_proj and v_proj [128, 128]
HIDDEN = 128
PREFIX = "base_model.model.model.layers.{layer}.self_attn.{module}"


def adapter_tensors(seed: int, rank: int = 4, targets: tuple[str, ...] = TARGETS, poison: str = "") -> dict[str, Any]:
    """A PEFT LoRA adapter's tensors (bfloat16, as the engine takes them): A ``[rank, in]``, B ``[out, rank]``
    per target module per layer, large enough to change the greedy tokens. ``poison`` names one that is NaN."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        for module in targets:
            base = PREFIX.format(layer=layer, module=module)
            out[f"{base}.lora_A.weight"] = (0.5 * torch.randn(rank, HIDDEN, generator=gen)).to(torch.bfloat16)
            out[f"{base}.lora_B.weight"] = (0.5 * torch.randn(HIDDEN, rank, generator=gen)).to(torch.bfloat16)
    if poison:
        out[poison] = torch.full_like(out[poison], float("nan"))
    return out


def every_linear_adapter(base: Path, seed: int, rank: int = 4) -> tuple[dict[str, Any], wire.AdapterSpec]:
    """An adapter on every linear layer of the decoder blocks of checkpoint ``base`` (packed q/k/v and gate/up,
    row-parallel o_proj and down_proj), with ``lora_alpha`` 3 (scaling 0.75), and its spec."""
    import torch

    from bridge.checkpoint import read_tensor_table
    from inference_side.lora import linear_modules

    gen = torch.Generator().manual_seed(seed)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    out = {}
    for module, (rows, cols) in sorted(linear_modules(read_tensor_table(str(base))).items()):
        if module.rsplit(".", 1)[-1] in targets:
            out[f"base_model.model.{module}.lora_A.weight"] = (0.1 * torch.randn(rank, cols, generator=gen)).to(torch.bfloat16)
            out[f"base_model.model.{module}.lora_B.weight"] = (0.1 * torch.randn(rows, rank, generator=gen)).to(torch.bfloat16)
    spec = wire.AdapterSpec(NAME, {"r": rank, "lora_alpha": 3, "target_modules": list(targets), "peft_type": "LORA",
                                   "task_type": "CAUSAL_LM", "bias": "none"})
    return out, spec


def adapter_spec(rank: int = 4, targets: tuple[str, ...] = TARGETS, name: str = NAME) -> wire.AdapterSpec:
    return wire.AdapterSpec(name, {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                                   "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none"})


def peft_dir(directory: Path, tensors: dict[str, Any], spec: wire.AdapterSpec) -> Path:
    """The adapter as PEFT saves it, for the oracle to load through vLLM's own LoRARequest."""
    from inference_side.lora import write_peft_dir

    return write_peft_dir(directory, spec.config, tensors)


def send_flipped_checksum_adapter(endpoint: str, version: int = 3) -> tuple[wire.Ack, str]:
    """A raw publisher sends a valid adapter manifest of ``version`` and one bucket whose first checksum is
    off by one bit; the engine's Ack and the name of the tensor whose checksum is off."""
    import torch

    name_a = PREFIX.format(layer=0, module="q_proj") + ".lora_A.weight"
    name_b = PREFIX.format(layer=0, module="q_proj") + ".lora_B.weight"
    a = torch.full((4, HIDDEN), 0.25, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    b = torch.full((HIDDEN, 4), 0.25, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    manifest = wire.Manifest(version=version, bucket_sizes=(len(a) + len(b),), adapter=adapter_spec(),
                             tensors=(wire.TensorSpec(name_a, "bfloat16", (4, HIDDEN), 0, 0, len(a)),
                                      wire.TensorSpec(name_b, "bfloat16", (HIDDEN, 4), 0, len(a), len(b))))
    client = RawClient(endpoint, identity=b"bad-adapter-checksum")
    try:
        client.send(wire.Begin(manifest))
        client.until(wire.Credit)
        client.send(wire.BucketHeader(version=version, index=0, checksums=(zlib.crc32(a) ^ 1, zlib.crc32(b))), a + b)
        ack: wire.Ack = client.until(wire.Ack)
    finally:
        client.close()
    return ack, name_a


def gen(actor: Any, adapter: str | None = None) -> list[dict[str, Any]]:
    import ray

    return ray.get(actor.generate.remote(PROMPTS, max_tokens=8, logprobs=1, adapter=adapter), timeout=600)


def publish(endpoint: str, tensors: dict[str, Any], version: int, spec: wire.AdapterSpec | None = None,
            transport: str | None = None) -> Any:
    from trainer_side import WeightPublisher

    with WeightPublisher([endpoint], transport=transport) as pub:
        return pub.publish(list(tensors.items()), version=version, adapter=spec or adapter_spec())


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def lora_engine(request: Any, ray_session: Any, checkpoints: Any, tmp_path_factory: Any) -> Any:
    from inference_side import InferenceActor

    base = checkpoints("tiny", 1)
    actor = InferenceActor.remote(model=str(base), tensor_parallel_size=request.param, dtype="bfloat16",
                                  enable_lora=True, max_lora_rank=MAX_RANK, max_loras=2, worker_extension_cls=FAULT_WORKER)
    endpoint = ray_session.get(actor.endpoint.remote(), timeout=900)
    yield {"actor": actor, "endpoint": endpoint, "base": base, "tp": request.param,
           "dir": tmp_path_factory.mktemp(f"adapters-tp{request.param}")}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


@pytest.fixture(scope="module")
def served(lora_engine: Any) -> Any:
    """Two adapter versions published over the bridge (v1 over ZMQ, v2 over shared memory), checked against
    the oracle; the engine serves v2."""
    import ray

    actor, endpoint = lora_engine["actor"], lora_engine["endpoint"]
    spec = adapter_spec()
    v1, v2 = adapter_tensors(11), adapter_tensors(12)
    dirs = [peft_dir(lora_engine["dir"] / f"v{i}", t, spec) for i, t in ((1, v1), (2, v2))]
    cold = lora_oracle(lora_engine["base"], dirs, lora_engine["tp"], "bfloat16", max_lora_rank=MAX_RANK, max_loras=2)
    base_before = gen(actor)
    got, reports = {}, {}
    for version, tensors, transport in ((1, v1, "zmq"), (2, v2, "shm")):
        report = publish(endpoint, tensors, version, spec, transport)
        assert report.ok and all(e.ok for e in report.engines), report
        assert ray.get(actor.adapter_version.remote(NAME)) == version
        got[version], reports[version] = gen(actor, NAME), report.engines[0].engine
    return {"cold": cold, "dirs": dirs, "got": got, "base_before": base_before, "v2": v2, "spec": spec,
            "reports": reports}


def test_adapter_versions_match_vllm_loading_the_peft_directory(lora_engine: Any, served: Any) -> None:
    cold, got = served["cold"], served["got"]
    for version, directory in ((1, served["dirs"][0]), (2, served["dirs"][1])):
        assert_same_outputs(got[version], cold[str(directory)])
        assert [o["adapter_version"] for o in got[version]] == [version] * len(PROMPTS)
    base = cold["base"]
    for version in (1, 2):  # the adapter changes what the engine says, and each version differently
        assert [o["token_ids"] for o in got[version]] != [o["token_ids"] for o in base]
    assert [o["token_ids"] for o in got[1]] != [o["token_ids"] for o in got[2]]


def test_base_outputs_unchanged(lora_engine: Any, served: Any) -> None:
    after = gen(lora_engine["actor"])
    assert after == served["base_before"]
    assert_same_outputs(after, served["cold"]["base"])
    assert all(o["adapter_version"] is None and o["version"] == 0 for o in after)


def test_status_and_records_show_the_adapter(lora_engine: Any, served: Any) -> None:
    import ray

    status = ray.get(lora_engine["actor"].status.remote())
    assert status["version"] == 0
    assert status["adapters"][NAME]["version"] == 2 and status["adapters"][NAME]["rank"] == 4
    records = [r for r in ray.get(lora_engine["actor"].records.remote()) if r["adapter"] == NAME and r["ok"]]
    assert [(r["version"], r["transport"]) for r in records][:2] == [(1, "zmq"), (2, "shm")]


def test_engine_reads_back_the_trainers_lora_weights(lora_engine: Any, served: Any) -> None:
    """After each adapter version was registered, every TP worker read its own LoRA weights for that version's
    slot back and found the trainer's (A, and B scaled by alpha / r, sliced into the packed qkv_proj and sharded
    per TP rank, bit for bit; k_proj and the untargeted layers zero), and no base weight moved."""
    tp = lora_engine["tp"]
    for version in (1, 2):
        report = served["reports"][version]
        readback = report["lora_readback"]
        assert readback["ok"] is True and len(readback["ranks"]) == tp, readback
        for rank, got in enumerate(readback["ranks"]):
            assert got["rank"] == rank and got["mismatches"] == [] and got["base_moved"] == [], got
            assert got["modules"] == LAYERS * len(TARGETS)  # every PEFT module the adapter carries
            assert got["slices"] > got["modules"]  # the slices it leaves out were read too (zero)
            assert got["bytes"] > 0 and got["base_tensors"] > 0 and got["slot"] is not None
        assert report["tensors_audited"] == tp * 2 * LAYERS * len(TARGETS)
        assert [r["rank"] for r in report["ranks"]] == list(range(tp)) and all(r["ok"] for r in report["ranks"])


def test_corrupted_lora_weights_fail_the_readback_and_the_previous_version_serves(lora_engine: Any, served: Any) -> None:
    """One value of the new version's B flipped in the engine's own LoRA weights (the test worker's hook, on every
    rank, after vLLM registered it): the read-back finds it, the update fails with kind ``stale`` naming the module,
    and the previous version keeps serving exactly as before."""
    import ray

    from bridge.errors import UpdateFailed

    actor, endpoint = lora_engine["actor"], lora_engine["endpoint"]
    version = ray.get(actor.adapter_version.remote(NAME))
    before = gen(actor, NAME)
    ray.get(actor.collective_rpc.remote("wb_arm_lora_corruption"))
    tensors, spec = every_linear_adapter(lora_engine["base"], 21)  # every layer kind, sharded at TP 2
    with pytest.raises(UpdateFailed) as info:
        publish(endpoint, tensors, version + 1, spec)
    reason = info.value.reasons[endpoint]
    # exactly the one value flipped on each rank: every other module of every layer kind read back as sent
    assert "LoRA read-back on TP rank 0: 1 mismatch(es)" in reason and "1 of" in reason, reason
    assert "values differ from the trainer's" in reason, reason
    assert f"(version {version} serves on)" in reason
    assert info.value.kinds[endpoint].value == "stale"
    assert ray.get(actor.adapter_version.remote(NAME)) == version
    assert gen(actor, NAME) == before
    record = ray.get(actor.records.remote())[-1]
    assert (record["ok"], record["kind"], record["adapter"]) == (False, "stale", NAME) and record["stale_tensors"]


def _one_tp(lora_engine: Any) -> None:
    if lora_engine["tp"] != 1:
        pytest.skip("decided on the receiver and the engine's validation, the same at every TP size")


def test_generate_with_an_unknown_adapter_is_refused(lora_engine: Any) -> None:
    import ray

    _one_tp(lora_engine)
    with pytest.raises(ray.exceptions.RayTaskError, match="serves no version of adapter 'nope'"):
        gen(lora_engine["actor"], "nope")


# ---- refusals: each names its problem; the previous adapter version keeps serving -----------------

def _poisoned() -> dict[str, Any]:
    return adapter_tensors(13, poison=PREFIX.format(layer=1, module="v_proj") + ".lora_B.weight")


REFUSALS = {
    "rank too large": (lambda: adapter_tensors(14, rank=16), lambda: adapter_spec(rank=16),
                       f"adapter {NAME}: rank r=16 is larger than the engine's max_lora_rank {MAX_RANK}"),
    "unknown target module": (lambda: adapter_tensors(15, targets=("q_proj", "w_proj")),
                              lambda: adapter_spec(targets=("q_proj", "w_proj")),
                              f"adapter {NAME}: unknown target module 'w_proj': the model has no such linear layer"),
    "shape": (lambda: {k: v[:, :64] if k.endswith("lora_A.weight") else v for k, v in adapter_tensors(16).items()},
              adapter_spec, "does not match [4, 128] (rank 4, base weight [128, 128])"),
    "NaN": (_poisoned, adapter_spec,
            "tensor base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight: holds NaN or Inf"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_adapter_refused_and_previous_version_serves(lora_engine: Any, served: Any, case: str) -> None:
    import ray

    from bridge.errors import UpdateFailed

    _one_tp(lora_engine)
    actor, endpoint = lora_engine["actor"], lora_engine["endpoint"]
    before = gen(actor, NAME)
    make, spec, expected = REFUSALS[case]
    with pytest.raises(UpdateFailed) as info:
        publish(endpoint, make(), 3, spec())
    assert expected in info.value.reasons[endpoint], info.value.reasons
    assert ray.get(actor.adapter_version.remote(NAME)) == 2
    assert gen(actor, NAME) == before
    assert_same_outputs(before, served["cold"][str(served["dirs"][1])])


def test_flipped_checksum_refused_and_previous_version_serves(lora_engine: Any, served: Any) -> None:
    """A raw publisher sends a valid adapter manifest and a bucket whose checksum is off by one bit."""
    import ray

    _one_tp(lora_engine)
    actor, endpoint = lora_engine["actor"], lora_engine["endpoint"]
    before = gen(actor, NAME)
    ack, name_a = send_flipped_checksum_adapter(endpoint)
    assert not ack.ok
    assert f"tensor {name_a}: checksum mismatch" in ack.reason, ack.reason
    assert ray.get(actor.adapter_version.remote(NAME)) == 2
    assert gen(actor, NAME) == before


def test_same_adapter_version_with_other_weights_is_a_conflict(lora_engine: Any, served: Any) -> None:
    """Re-sending the served adapter version: the same weights are a checked no-op; other weights are a
    VersionConflict, and the served version keeps serving. An older version is refused."""
    import ray

    from bridge.errors import UpdateFailed

    _one_tp(lora_engine)
    actor, endpoint = lora_engine["actor"], lora_engine["endpoint"]
    before = gen(actor, NAME)
    (again,) = publish(endpoint, served["v2"], 2, served["spec"]).engines
    assert again.noop and again.engine.get("content_checked") is True
    with pytest.raises(UpdateFailed) as info:
        publish(endpoint, adapter_tensors(99), 2, served["spec"])
    assert info.value.reasons[endpoint].startswith("VersionConflict: version 2 is already served with different weights")
    with pytest.raises(UpdateFailed) as older:
        publish(endpoint, adapter_tensors(98), 1, served["spec"])
    assert f"adapter {NAME}: version 1 is older than the served version 2" in older.value.reasons[endpoint]
    assert ray.get(actor.adapter_version.remote(NAME)) == 2
    assert gen(actor, NAME) == before


def test_adapter_versions_over_ipc_and_gloo_serve_the_same_adapter(lora_engine: Any, served: Any) -> None:
    """The adapter door takes every transport: v2's tensors published again as versions 3 (ZMQ on the
    engine's ipc:// endpoint) and 4 (gloo, bucket by bucket point to point) serve exactly what the oracle
    loaded for v2, and the records name each transport."""
    import ray

    _one_tp(lora_engine)
    actor = lora_engine["actor"]
    want = served["cold"][str(served["dirs"][1])]
    version = ray.get(actor.adapter_version.remote(NAME))
    for kind, transport, recorded in (("ipc", "zmq", "zmq"), ("tcp", "gloo", "gloo")):
        version += 1
        report = publish(ray.get(actor.endpoint.remote(kind)), served["v2"], version, served["spec"], transport)
        assert report.ok and all(e.ok and not e.noop for e in report.engines), report
        assert ray.get(actor.adapter_version.remote(NAME)) == version
        assert_same_outputs(gen(actor, NAME), want)
        record = ray.get(actor.records.remote())[-1]
        assert (record["version"], record["ok"], record["transport"]) == (version, True, recorded), record


def test_an_adapter_from_two_fsdp2_ranks_serves_like_vllm_loading_its_peft_directory(lora_engine: Any, served: Any,
                                                                                    tmp_path: Path) -> None:
    """Two real ranks (gloo), each holding its chunks of the adapter (``lora_A`` column shards, strided; ``lora_B``
    row shards; DTensors), publish adapter ``ranks`` versions 1 and 2 with ``RankedPublisher``: the ranks assemble
    it on rank 0's host and rank 0 sends it whole. With version 2 (the content of ``math`` version 2) the engine
    generates as vLLM loading that PEFT directory itself, the workers' read-back finding the trainer's weights."""
    import ray

    from tests.ranks import run_ranks

    codes, results, logs = run_ranks(lora_engine["endpoint"], "adapter", 2, tmp_path, transport="zmq")
    assert codes == [0, 0], logs
    for res in results:
        assert [(r["version"], r["ok"]) for r in res] == [(1, True), (2, True)], (res, logs)
    assert results[0][1]["engine"]["lora_readback"]["ok"] is True, results[0][1]["engine"]
    assert ray.get(lora_engine["actor"].adapter_version.remote("ranks")) == 2
    assert_same_outputs(gen(lora_engine["actor"], "ranks"), served["cold"][str(served["dirs"][1])])
