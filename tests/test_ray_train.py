"""Ray Train as the multi-rank launcher, end to end: ``ray.train.torch.TorchTrainer`` with two CPU workers
(gloo), tiny Qwen2 under FSDP2 ``fully_shard`` and ``full_tensor`` made to raise in them
(examples/ray_train_publish.py), each worker sending its own shards over ZMQ to a real engine
(``InferenceActor``) it finds by name. Versions 2 and 3 are applied and verified, and the engine then equals an
engine cold-loaded from the full weights (the oracle, built unsharded here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, generate, oracle
from tests.ranks import full_weights

pytestmark = pytest.mark.engine

ENGINE = "wb-ray-train-engine"


@pytest.fixture(scope="module")
def engine(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    actor = InferenceActor.options(name=ENGINE).remote(  # type: ignore[attr-defined]
        model=str(checkpoints("tiny", 1)), tensor_parallel_size=1, dtype="bfloat16")
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield actor
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def test_ray_train_workers_publish_their_shards_and_the_engine_equals_cold_load(engine: Any, tmp_path: Path) -> None:
    import ray

    from devtools.tiny_models import save_checkpoint
    from examples.ray_train_publish import train

    before = generate(engine)
    metrics = train([ENGINE], workers=2, steps=2, storage=tmp_path / "ray", first=2, seed=2, scale=0.5,
                    cpus_per_worker=0.5)
    assert (metrics["rank"], metrics["world"]) == (0, 2), metrics
    assert [(r["version"], r["ok"], r.get("verified")) for r in metrics["results"]] == [(2, True, [True]), (3, True, [True])], metrics
    assert ray.get(engine.version.remote()) == 3
    records = [r for r in ray.get(engine.records.remote()) if r["version"] in (2, 3)]
    assert records and all(r["ok"] for r in records), records
    after = generate(engine)
    (cold,) = oracle([save_checkpoint(full_weights(2, 0.5), tmp_path / "v3")], 1, "bfloat16")
    assert_same_outputs(after, cold)
    assert [o["token_ids"] for o in after] != [o["token_ids"] for o in before], "the update did not change the outputs"
