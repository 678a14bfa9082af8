"""LoRA adapters as versions through ``vllm serve`` (the ``weight_bridge`` backend and its adapter route): a server
started with ``--enable-lora`` takes adapter versions from vLLM's own trainer-side API (``HTTPVLLMWeightSyncClient``,
``WeightBridgeTrainerEngine.send_adapter``) and then answers requests naming the adapter (``"model": "math"``)
exactly as a plain vLLM engine that loads the same PEFT directory itself, for two successive versions, each
answer naming the version that served it (``"model": "math@v2"``); its base-model answers and ``/weight_info`` stay
as they were; bad adapters are refused with their reason over HTTP and the previous adapter version keeps
serving; a base update leaves the adapter version served, applied to the new base. One server per TP size (tiny
Qwen2, TP 1 and 2); the refusals, the route's checks and the base update at TP 1 only (decided on each rank's
receiver and gate alike, the ranks agreeing as in every update)."""

from __future__ import annotations

import os
import threading
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import PROMPTS, assert_same_outputs, child_env, lora_oracle
from tests.test_lora import (
    MAX_RANK,
    NAME,
    PREFIX,
    adapter_spec,
    adapter_tensors,
    peft_dir,
    send_flipped_checksum_adapter,
)

pytestmark = pytest.mark.engine
PORTS = {1: (18110, 18120), 2: (18111, 18130)}  # TP size -> the HTTP server's port, the TP rank 0 receiver's
ROUTE = "inference_side.vllm_adapters:AdapterRoutes"


def _endpoint_plugin_path(root: Path) -> str:
    """A directory declaring the adapter route's ``vllm.endpoint_plugins`` entry point as pyproject.toml does, for the
    server's ``PYTHONPATH`` while this checkout's installed metadata predates it ("" when it is installed)."""
    if any(e.value == ROUTE for e in entry_points(group="vllm.endpoint_plugins")):
        return ""
    info = root / "weight_bridge_endpoint-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weight-bridge-endpoint\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.endpoint_plugins]\nweight_bridge = {ROUTE}\n")
    return str(root)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request: Any, tmp_path_factory: Any) -> Any:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from devtools.serve import served
    from devtools.tiny_models import build_model, save_checkpoint, save_word_tokenizer
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    tp = request.param
    serve_port, base_port = PORTS[tp]
    model = build_model("tiny", seed=1)
    ckpt = save_checkpoint(model, tmp_path_factory.mktemp("serve-lora"))
    save_word_tokenizer(ckpt, model.config.vocab_size)
    env = child_env(VLLM_PLUGINS="weight_bridge")  # vLLM loads endpoint plugins only when named
    extra_path = _endpoint_plugin_path(tmp_path_factory.mktemp("entry-points"))
    if extra_path:
        env["PYTHONPATH"] += os.pathsep + extra_path
    lora = ("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2")
    log = tmp_path_factory.mktemp("serve-lora-log") / "server.log"
    with served(ckpt, serve_port, log, tp=tp, extra=lora, env=env) as url:
        lora_dir = str(tmp_path_factory.mktemp("verified-adapters"))  # where the workers write what they verified
        trainer = WeightTransferTrainerFactory.trainer_init(
            WeightBridgeInitInfo(rank=0, base_port=base_port, tp_size=tp, lora_dir=lora_dir),
            client=HTTPVLLMWeightSyncClient(url), source=None)
        yield {"url": url, "ckpt": ckpt, "trainer": trainer, "log": log, "tp": tp, "base_port": base_port, "lora_dir": lora_dir,
               "dir": tmp_path_factory.mktemp("adapters")}
        trainer.shutdown()


def complete(server: Any, model: str | None = None) -> tuple[list[dict[str, Any]], set[str]]:
    """Greedy completions of PROMPTS (token ids, logprobs) naming ``model`` (default: the base), and the names the
    answers gave as their ``model``."""
    import requests

    out, names = [], set()
    for prompt in PROMPTS:
        r = requests.post(f"{server['url']}/v1/completions", timeout=120, json={
            "model": model or str(server["ckpt"]), "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        names.add(body["model"])
        choice = body["choices"][0]
        out.append({"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]})
    return out, names


def weight_info(server: Any) -> Any:
    import requests

    return requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"]


def served_adapters(server: Any) -> dict[str, Any]:
    import requests

    from bridge.vllm_plugin import ADAPTER_ROUTE

    r = requests.get(f"{server['url']}{ADAPTER_ROUTE}", timeout=10)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.fixture(scope="module")
def served(server: Any) -> Any:
    """Two adapter versions sent over the bridge, the oracle's outputs for them and the base."""
    spec = adapter_spec()
    v1, v2 = adapter_tensors(11), adapter_tensors(12)
    dirs = [peft_dir(server["dir"] / f"v{i}", t, spec) for i, t in ((1, v1), (2, v2))]
    cold = lora_oracle(server["ckpt"], dirs, server["tp"], "bfloat16", max_lora_rank=MAX_RANK, max_loras=2)
    label = weight_info(server)
    base_before, _ = complete(server)
    got, answers = {}, {}
    for version, tensors in ((1, v1), (2, v2)):
        answers[version] = server["trainer"].send_adapter(tensors, spec)
        got[version] = complete(server, NAME)
    return {"cold": cold, "dirs": dirs, "got": got, "answers": answers, "base_before": base_before, "label": label,
            "v2": v2, "spec": spec}


def test_adapter_versions_match_vllm_loading_the_peft_directory(server: Any, served: Any) -> None:
    cold, got = served["cold"], served["got"]
    for version, directory in ((1, served["dirs"][0]), (2, served["dirs"][1])):
        outputs, names = got[version]
        assert served["answers"][version]["served"] == f"{NAME}@v{version}", served["answers"][version]
        assert names == {f"{NAME}@v{version}"}  # each answer names the adapter version that served it
        assert_same_outputs(outputs, cold[str(directory)])
    base = cold["base"]
    for version in (1, 2):  # the adapter changes what the server says, and each version differently
        assert [o["token_ids"] for o in got[version][0]] != [o["token_ids"] for o in base]
    assert [o["token_ids"] for o in got[1][0]] != [o["token_ids"] for o in got[2][0]]


def test_base_outputs_and_version_unchanged(server: Any, served: Any) -> None:
    import requests

    after, names = complete(server)
    assert after == served["base_before"] and names == {str(server["ckpt"])}
    assert_same_outputs(after, served["cold"]["base"])
    assert weight_info(server) == served["label"]  # the base's version label did not move
    adapters = served_adapters(server)
    assert adapters[NAME]["version"] == 2 and adapters[NAME]["served"] == f"{NAME}@v2"
    assert adapters[NAME]["path"] == str(Path(server["lora_dir"]) / NAME / "v2")
    listed = {m["id"] for m in requests.get(f"{server['url']}/v1/models", timeout=10).json()["data"]}
    assert f"{NAME}@v2" in listed and f"{NAME}@v1" not in listed


def _one_tp(server: Any) -> None:
    if server["tp"] != 1:
        pytest.skip("decided on each rank's receiver and gate alike: checked at TP 1")


def _still_v2(server: Any, served: Any) -> None:
    assert served_adapters(server)[NAME]["version"] == 2
    outputs, names = complete(server, NAME)
    assert names == {f"{NAME}@v2"}
    assert_same_outputs(outputs, served["cold"][str(served["dirs"][1])])


REFUSALS = {
    "rank too large": (lambda: adapter_tensors(14, rank=16), lambda: adapter_spec(rank=16),
                       f"adapter {NAME}: rank r=16 is larger than the engine's max_lora_rank {MAX_RANK}"),
    "unknown target module": (lambda: adapter_tensors(15, targets=("q_proj", "w_proj")),
                              lambda: adapter_spec(targets=("q_proj", "w_proj")),
                              f"adapter {NAME}: unknown target module 'w_proj': the model has no such linear layer"),
    "NaN": (lambda: adapter_tensors(13, poison=PREFIX.format(layer=1, module="v_proj") + ".lora_B.weight"), adapter_spec,
            "tensor base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight: holds NaN or Inf"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_adapter_refused_over_http_and_previous_version_serves(server: Any, served: Any, case: str) -> None:
    from bridge.errors import UpdateFailed

    _one_tp(server)
    make, spec, expected = REFUSALS[case]
    with pytest.raises(UpdateFailed) as info:
        server["trainer"].send_adapter(make(), spec(), version=3)
    answered = info.value.reasons["update_weights"]  # vLLM's /update_weights: an error status and the reason
    assert answered.startswith("HTTP 5") and expected in answered, answered
    assert any(expected in r for k, r in info.value.reasons.items() if k != "update_weights"), info.value.reasons
    _still_v2(server, served)


def test_flipped_checksum_refused_over_http_and_previous_version_serves(server: Any, served: Any) -> None:
    """A raw publisher sends a valid adapter manifest and a bucket whose checksum is off by one bit, while vLLM's
    ``update_weights`` holds the worker in the update."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    _one_tp(server)
    url = server["url"]
    client = HTTPVLLMWeightSyncClient(url)
    client.start_weight_update()
    answers: list[Any] = []
    held = threading.Thread(target=lambda: answers.append(requests.post(f"{url}/update_weights", timeout=300, json={
        "update_info": {"version": 3, "adapter": NAME, "timeout_s": 120}})), daemon=True)
    held.start()
    ack, name_a = send_flipped_checksum_adapter(f"tcp://127.0.0.1:{server['base_port']}")
    held.join(300)
    with pytest.raises(requests.HTTPError):  # the worker that raised closed its session already (as the trainer expects)
        client.finish_weight_update()
    assert not ack.ok and f"tensor {name_a}: checksum mismatch" in ack.reason, ack.reason
    (answer,) = answers
    assert answer.status_code >= 500 and f"tensor {name_a}: checksum mismatch" in answer.text, answer.text
    _still_v2(server, served)


def test_same_version_with_other_weights_is_a_conflict_and_older_is_refused(server: Any, served: Any) -> None:
    from bridge.errors import UpdateFailed

    _one_tp(server)
    trainer = server["trainer"]
    assert trainer.send_adapter(served["v2"], served["spec"], version=2) == {"noop": True}  # same weights: a no-op
    with pytest.raises(UpdateFailed) as conflict:
        trainer.send_adapter(adapter_tensors(99), served["spec"], version=2)
    assert "VersionConflict: version 2 is already served with different weights" in str(conflict.value)
    with pytest.raises(UpdateFailed) as older:
        trainer.send_adapter(adapter_tensors(98), served["spec"], version=1)
    assert f"adapter {NAME}: version 1 is older than the served version 2" in older.value.reasons["update_weights"]
    _still_v2(server, served)


def test_adapter_route_serves_only_verified_newer_versions(server: Any, served: Any) -> None:
    import requests

    from bridge.vllm_plugin import ADAPTER_ROUTE

    _one_tp(server)
    route = f"{server['url']}{ADAPTER_ROUTE}"
    path = served_adapters(server)[NAME]["path"]
    unmarked = served["dirs"][0]  # a PEFT directory the backend never verified
    r = requests.post(route, json={"name": NAME, "version": 5, "path": str(unmarked)}, timeout=30)
    assert r.status_code == 400 and "is not an adapter directory the weight_bridge backend verified" in r.text, r.text
    r = requests.post(route, json={"name": NAME, "version": 5, "path": path}, timeout=30)
    assert r.status_code == 400 and f"holds adapter '{NAME}' version 2, not '{NAME}' version 5" in r.text, r.text
    r = requests.post(route, json={"name": NAME, "version": 2, "path": path}, timeout=30)
    assert r.status_code == 200 and r.json()["noop"] is True, r.text
    _still_v2(server, served)


def test_base_update_keeps_the_adapter_version_on_the_new_base(server: Any, served: Any, tmp_path: Path) -> None:
    """A full-weight update: the base's label moves, the adapter keeps its version, applied to the new base (vLLM
    drops its loaded adapters after a weight update and reloads them from their directories)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from devtools.tiny_models import build_model, save_checkpoint

    _one_tp(server)
    model = build_model("tiny", seed=2)
    trainer = server["trainer"]
    trainer.source = ModuleSource(model)
    trainer.send_weights()
    assert weight_info(server) == str(trainer.version)
    ckpt = save_checkpoint(model, tmp_path / "base-v2")
    cold = lora_oracle(ckpt, [served["dirs"][1]], 1, "bfloat16", max_lora_rank=MAX_RANK, max_loras=2)
    outputs, names = complete(server, NAME)
    assert names == {f"{NAME}@v2"} and served_adapters(server)[NAME]["version"] == 2
    assert_same_outputs(outputs, cold[str(served["dirs"][1])])
    assert_same_outputs(complete(server)[0], cold["base"])


def test_an_adapter_from_two_fsdp2_ranks_serves_as_the_same_adapter_from_one(server: Any, served: Any, tmp_path: Path) -> None:
    """Two torchrun ranks build the trainer engine with ``trainer_ranks=2`` and call ``send_adapter`` on every rank
    with their chunks of adapter ``ranks`` (DTensors: ``lora_A`` column shards, ``lora_B`` row shards), versions 1
    and 2 (the contents of ``math`` versions 1 and 2): both ranks return, rank 0 with the route's answer, and the
    server answers requests naming ``ranks`` exactly as it answers those naming ``math`` (version 2, checked
    against vLLM loading its PEFT directory above)."""
    import json

    from tests.helpers import free_port_in
    from tests.ranks import torchrun

    master = free_port_in(range(18140, 18200))
    assert master is not None
    code, log = torchrun([server["url"], str(server["base_port"]), str(tmp_path), "adapter", str(server["tp"]),
                          server["lora_dir"]], master)
    assert code == 0, log[-6000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert [(r["version"], r["ok"], r["held"]) for r in zero] == [(1, True, 1), (2, True, 2)], (zero, log[-6000:])
    assert [(r["version"], r["ok"], r["held"], r["answer"]) for r in one] == [(1, True, 1, {}), (2, True, 2, {})], one
    assert zero[1]["answer"].get("served") == "ranks@v2", zero[1]["answer"]
    outputs, names = complete(server, "ranks")
    assert names == {"ranks@v2"}
    assert_same_outputs(outputs, complete(server, NAME)[0], tol=0.0)
