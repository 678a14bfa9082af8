"""TRL 1.16's ``GRPOTrainer`` in server mode against a real ``vllm serve`` (tiny Qwen2, TP 1, the
``weight_bridge`` backend), its weight sync through ``trainer_side.trl`` (examples/trl_grpo.py builds the
trainer): three training steps on CPU, each sync a version that ``/weight_info`` names; after a last sync the
server's completions (token ids and logprobs) equal an engine cold-loaded from the trainer's current weights
and differ from the starting checkpoint's; TRL's per-parameter path (``weight_update()`` +
``update_named_param``) publishes one version per block, nothing when the block raises, and a lone tensor
outside a block is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import PROMPTS, assert_same_outputs, child_env, oracle

pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore:TRL currently supports vLLM")]
HTTP_PORT, BASE_PORT = 27620, 27630


@pytest.fixture(scope="module")
def server(tmp_path_factory: Any) -> Any:
    from devtools.serve import served
    from examples.trl_grpo import make_checkpoint

    root = tmp_path_factory.mktemp("trl")
    ckpt = make_checkpoint(root / "ckpt")
    with served(ckpt, HTTP_PORT, root / "server.log", extra=("--logprobs-mode", "processed_logprobs"),
                env=child_env()) as url:
        yield {"url": url, "ckpt": ckpt}


def _served(server: Any) -> list[dict[str, Any]]:
    from examples.trl_grpo import served_answer

    return [served_answer(server["url"], str(server["ckpt"]), prompt) for prompt in PROMPTS]


def _weight_version(server: Any) -> str:
    import requests

    return str(requests.get(f"{server['url']}/weight_info", timeout=10).json()["weight_version"])


def test_grpo_trainer_syncs_through_weight_bridge(server: Any, tmp_path: Path) -> None:
    from bridge.errors import ConfigError
    from devtools.tiny_models import save_checkpoint
    from examples.trl_grpo import build_trainer, step_reporter
    from trainer_side.trl import WeightBridgeVLLMClient

    report = step_reporter(server["url"], str(server["ckpt"]))
    trainer = build_trainer(server["url"], server["ckpt"], tmp_path / "out", steps=3, base_port=BASE_PORT,
                            callbacks=[report])
    client = trainer.vllm_generation.vllm_client
    assert isinstance(client, WeightBridgeVLLMClient)
    report.client = client
    trainer.train()
    assert trainer.state.global_step == 3
    # TRL synced before each step's generation: one version each, and the server took it
    assert [(x["synced_version"], x["served_version"]) for x in report.lines] == [(1, "1"), (2, "2"), (3, "3")]
    assert any(x["served_output_changed"] for x in report.lines[1:]), report.lines
    # a last sync of the trained policy (TRL's own path), then the server answers as a cold load of it does
    trainer.vllm_generation.sync_weights()
    assert client.engine.version == 4 and _weight_version(server) == "4"
    final = save_checkpoint(trainer.model, tmp_path / "final")
    start, trained = oracle([server["ckpt"], final], 1, "bfloat16")
    got = _served(server)
    assert_same_outputs(got, trained)
    assert got != start, "training did not change what the server generates"

    # TRL's per-parameter path: a block that raises publishes nothing; a whole block is one version
    params = [(n, p.data) for n, p in trainer.model.named_parameters()]
    with pytest.raises(RuntimeError, match="stop"), client.weight_update():
        client.update_named_param(*params[0])
        raise RuntimeError("stop")
    assert _weight_version(server) == "4"
    with client.weight_update():
        for name, tensor in params:
            client.update_named_param(name, tensor)
    assert client.engine.version == 5 and _weight_version(server) == "5"
    assert_same_outputs(_served(server), trained)
    with pytest.raises(ConfigError, match="weight_update"):
        client.update_named_param(*params[0])
    with pytest.raises(Exception, match="announced"):
        client.update_named_params([(params[0][0], "float32", [1])], iter(params[:1]))
    assert _weight_version(server) == "5"
    client.close_communicator()
