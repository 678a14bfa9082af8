"""Trainers that span many processes on tiny GPT-OSS (sinks, fused experts, router biases): two real ranks
under FSDP2 over gloo (every parameter ``Shard(0)``), then four (square weights ``Shard(1)`` through FSDP2's
``shard_placement_fn``, the rest ``Shard(0)``), each publish two versions into one real engine, each rank
writing only its own shards, and the engine equals an engine cold-loaded from the full weights
(tests/test_multi_rank_engine.py has the failures, on tiny Qwen2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, generate, oracle
from tests.ranks import assert_fsdp2_split, full_weights, run_ranks, shard_geometry

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    actor = InferenceActor.remote(model=str(checkpoints("gpt_oss", 1)), tensor_parallel_size=1, dtype="bfloat16")
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield actor
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


@pytest.mark.parametrize(("world", "first", "shard"), [(2, 2, "rows"), (4, 4, "mixed")])
def test_fsdp2_ranks_publish_gpt_oss_equal_cold_load(engine: Any, tmp_path: Path, world: int, first: int, shard: str) -> None:
    """Versions ``first`` (``build_model("gpt_oss", first)``) and ``first + 1`` (its weights times 0.5,
    scaled on the ranks' local shards); the 4-rank case starts from the 2-rank case's version 3."""
    import ray

    from devtools.tiny_models import save_checkpoint

    before = generate(engine)
    codes, results, logs = run_ranks(str(ray.get(engine.endpoint.remote("ipc"))), "versions", world, tmp_path,
                                     first=first, kind="gpt_oss", shard=shard)
    assert codes == [0] * world, logs
    full = full_weights(first, 0.5, "gpt_oss")
    placements = assert_fsdp2_split(shard_geometry(tmp_path, world), full)
    assert placements == ({"Shard(0)"} if shard == "rows" else {"Shard(0)", "Shard(1)"}), placements
    for rank, res in enumerate(results):
        assert [(r["version"], r["ok"], r.get("verified")) for r in res] == [(first, True, [True]), (first + 1, True, [True])], (rank, res, logs)
    assert ray.get(engine.version.remote()) == first + 1
    after = generate(engine)
    (cold,) = oracle([save_checkpoint(full, tmp_path / f"v{first + 1}")], 1, "bfloat16")
    assert_same_outputs(after, cold)
    assert [o["token_ids"] for o in after] != [o["token_ids"] for o in before], "the update did not change the outputs"
