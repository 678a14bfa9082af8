"""Trainers that span many processes on tiny GPT-OSS (sinks, fused experts, router biases): two real ranks
under FSDP2 over gloo publish two versions into a real engine, each rank writing only its own shards, and
the engine equals an engine cold-loaded from the full weights (tests/test_multi_rank_engine.py has the
failures, on tiny Qwen2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, generate, oracle
from tests.ranks import full_weights, run_ranks

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    actor = InferenceActor.remote(model=str(checkpoints("gpt_oss", 1)), tensor_parallel_size=1, dtype="bfloat16")
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield actor
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def test_fsdp2_ranks_publish_gpt_oss_equal_cold_load(engine: Any, tmp_path: Path) -> None:
    import ray

    from devtools.tiny_models import save_checkpoint

    before = generate(engine)
    codes, results, logs = run_ranks(str(ray.get(engine.endpoint.remote("ipc"))), "versions", 2, tmp_path, kind="gpt_oss")
    assert codes == [0, 0], logs
    for rank, res in enumerate(results):
        assert [(r["version"], r["ok"], r["verified"]) for r in res] == [(2, True, [True]), (3, True, [True])], (rank, res, logs)
    assert ray.get(engine.version.remote()) == 3
    after = generate(engine)
    (cold,) = oracle([save_checkpoint(full_weights(2, 0.5, "gpt_oss"), tmp_path / "v3")], 1, "bfloat16")
    assert_same_outputs(after, cold)
    assert [o["token_ids"] for o in after] != [o["token_ids"] for o in before], "the update did not change the outputs"
