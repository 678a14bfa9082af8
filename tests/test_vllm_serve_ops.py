"""Operations of an engine behind ``vllm serve`` (the ``weight_bridge`` backend): its engine keeps a sync record
of every update and answers the dashboard over its receiver's endpoint. One real server (tiny Qwen2, TP 1),
driven by vLLM's ``HTTPVLLMWeightSyncClient`` and the trainer engine: one good update, one refused (NaN, kind
``nonfinite``). Then the dashboard's ``ReceiverSource`` finds both records and the served version; the JSON API,
Prometheus text and the page (real Chromium) show the engine; ``weight-bridge serve --vllm-serve`` does the same
from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from apps.dashboard import DashboardService, ReceiverSource
from apps.metrics import MetricsHub
from tests.helpers import ROOT, child_env, vllm_serve, wait_until
from tests.test_dashboard import CHROMIUM, DomParser, chromium

pytestmark = pytest.mark.engine
HTTP_PORT, BASE_PORT, DASHBOARD_PORT, CLI_PORT = 27800, 27810, 27820, 27821
ENGINE = f"vllm@127.0.0.1:{BASE_PORT}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge.errors import UpdateFailed
    from devtools.tiny_models import build_model, save_checkpoint, save_word_tokenizer
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    root = tmp_path_factory.mktemp("serve-ops")
    model = build_model("tiny", seed=1)
    ckpt = save_checkpoint(model, root / "ckpt")
    save_word_tokenizer(ckpt, model.config.vocab_size)
    with vllm_serve(ckpt, HTTP_PORT, root / "server.log") as url:
        trainer = WeightTransferTrainerFactory.trainer_init(WeightBridgeInitInfo(rank=0, base_port=BASE_PORT),
                                                            client=HTTPVLLMWeightSyncClient(url), source=None)
        good = build_model("tiny", seed=2)
        trainer.source = ModuleSource(good)
        trainer.send_weights()  # version 1
        poisoned = build_model("tiny", seed=3)
        name, param = next(iter(poisoned.named_parameters()))
        with torch.no_grad():
            param.view(-1)[0] = float("nan")
        trainer.source = ModuleSource(poisoned)
        with pytest.raises(UpdateFailed):
            trainer.send_weights()  # version 2: refused
        trainer.shutdown()
        params = list(good.named_parameters())
        yield {"url": url, "poisoned": name, "tensors": len(params), "bytes": sum(p.numel() * 2 for _, p in params)}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_the_engine_keeps_a_record_of_each_update_and_answers_over_its_receiver(served: dict[str, Any]) -> None:
    source = ReceiverSource(f"127.0.0.1:{BASE_PORT}", timeout_s=30)
    try:
        status, records = source()
    finally:
        source.close()
    assert (status["engine"], status["version"], status["tp_size"], status["dtype"]) == (ENGINE, 1, 1, "bfloat16")
    assert status["endpoint"] == f"tcp://127.0.0.1:{BASE_PORT}" and status["sessions"] == []
    assert status["last_failure"]["kind"] == "nonfinite"
    assert [(r["engine"], r["version"], r["ok"], r["kind"]) for r in records] == [
        (ENGINE, 1, True, ""), (ENGINE, 2, False, "nonfinite")]
    ok, refused = records
    assert (ok["bytes"], ok["tensors"]) == (served["bytes"], served["tensors"])
    assert ok["tensors_audited"] > 0 and ok["stale_tensors"] == [] and ok["identity_violations"] == []
    assert ok["seconds"]["total"] > 0 and ok["seconds"]["load"] > 0 and ok["seconds"]["apply"] > 0 and ok["transport"]
    assert served["poisoned"] in refused["reason"]


def test_the_receiver_runs_beside_the_worker_not_on_its_cores(served: dict[str, Any]) -> None:
    """vLLM binds the TP worker to its cores; the receiver living in the worker's process (and ZMQ's I/O
    thread) must not inherit that binding, or landing and verifying would share the loading core."""
    source = ReceiverSource(f"127.0.0.1:{BASE_PORT}", timeout_s=30)
    try:
        status, _ = source()
    finally:
        source.close()
    worker, receiver = set(status["cores"]["worker"]), set(status["cores"]["receiver"])
    if worker >= set(os.sched_getaffinity(0)):
        pytest.skip(f"vLLM bound the worker to every core of this machine ({sorted(worker)})")
    assert worker and receiver - worker, (sorted(worker), sorted(receiver))


def test_the_dashboard_shows_the_engine_its_records_and_metrics(served: dict[str, Any]) -> None:
    hub = MetricsHub()
    source = ReceiverSource(f"tcp://127.0.0.1:{BASE_PORT}", timeout_s=30)
    with DashboardService(hub, port=DASHBOARD_PORT, sources=[source], poll_interval_s=0.5) as svc:
        view = wait_until(lambda: [e for e in _get_json(f"{svc.url}/api/engines")["engines"] if e["engine"] == ENGINE],
                          60, "the vllm serve engine on /api/engines")
        assert (view[0]["version"], view[0]["health"], view[0]["syncs"], view[0]["failures"]) == (1, "ok", 2, 1)
        assert view[0]["last_sync"]["failure_class"] == "nonfinite"
        records = _get_json(f"{svc.url}/api/records?engine={ENGINE}")
        assert [(r["version"], r["ok"], r["kind"]) for r in records] == [(1, True, ""), (2, False, "nonfinite")]
        with urllib.request.urlopen(f"{svc.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for line in (f'weight_bridge_syncs_total{{engine="{ENGINE}",result="ok"}} 1.0',
                     f'weight_bridge_syncs_total{{engine="{ENGINE}",result="failed"}} 1.0',
                     f'weight_bridge_sync_failures_total{{engine="{ENGINE}",reason="nonfinite"}} 1.0',
                     f'weight_bridge_engine_weight_version{{engine="{ENGINE}"}} 1.0',
                     f'weight_bridge_engine_up{{engine="{ENGINE}"}} 1.0'):
            assert line in text, f"{line!r} not in /metrics:\n{text}"
        if not CHROMIUM.exists():  # no browser here: the JSON API above is the check
            return
        proc = chromium("--virtual-time-budget=5000", "--dump-dom", f"{svc.url}/")
        assert proc.returncode == 0, proc.stderr[-3000:]
        parser = DomParser()
        parser.feed(proc.stdout)
        rows = {r.attrs["data-engine"]: r for r in parser.root.find_all("engine-row")}
        assert set(rows) == {ENGINE} and rows[ENGINE].find("engine-version").text == "v1"


def test_weight_bridge_serve_polls_an_engine_behind_vllm_serve(served: dict[str, Any]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "--port", str(CLI_PORT), "--poll-interval", "0.5",
                             "--vllm-serve", f"127.0.0.1:{BASE_PORT}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=child_env())
    try:
        def engines() -> Any:
            try:
                return [e for e in _get_json(f"http://127.0.0.1:{CLI_PORT}/api/engines")["engines"] if e["engine"] == ENGINE]
            except OSError:
                return None

        [engine] = wait_until(engines, 120, "the dashboard started by the CLI to list the engine")
        assert (engine["version"], engine["syncs"], engine["failures"]) == (1, 2, 1)
    finally:
        proc.terminate()
        proc.wait(30)
