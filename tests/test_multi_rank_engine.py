"""Trainers that span many processes, end to end: two real ranks (torch.distributed over gloo, FSDP2
``fully_shard`` of tiny Qwen2, ``full_tensor`` made to raise in them) publish with ``RankedPublisher`` into
a real engine (``InferenceActor``) over shared memory, each rank writing only its own shards. The engine
then equals an engine cold-loaded from the full weights (the oracle, built unsharded here); a rank killed
mid-publish, one claiming another rank's bytes, or one whose bytes changed after it summed them leaves it on its
version, the error naming the rank. Last, four ranks with row and column shards publish two more versions into
the same engine, again equal to a cold load; and with deltas on two ranks send seven more versions (deltas, one
resent dense to a wrong base) after which the engine equals a cold load, its weights read back bit for bit."""

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

    actor = InferenceActor.remote(model=str(checkpoints("tiny", 1)), tensor_parallel_size=1, dtype="bfloat16")
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield actor
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def _endpoint(actor: Any) -> str:
    import ray

    return str(ray.get(actor.endpoint.remote("ipc")))


def test_fsdp2_ranks_publish_two_versions_equal_cold_load(engine: Any, tmp_path: Path) -> None:
    import ray

    from devtools.tiny_models import save_checkpoint

    before = generate(engine)
    codes, results, logs = run_ranks(_endpoint(engine), "versions", 2, tmp_path)
    assert codes == [0, 0], logs
    for rank, res in enumerate(results):  # every rank returns the same report
        assert [(r["version"], r["ok"], r["verified"]) for r in res] == [(2, True, [True]), (3, True, [True])], (rank, res, logs)
    assert ray.get(engine.version.remote()) == 3
    after = generate(engine)
    full = full_weights(2, 0.5)
    assert assert_fsdp2_split(shard_geometry(tmp_path, 2), full) == {"Shard(0)"}
    (cold,) = oracle([save_checkpoint(full, tmp_path / "v3")], 1, "bfloat16")
    assert_same_outputs(after, cold)
    assert [o["token_ids"] for o in after] != [o["token_ids"] for o in before], "the update did not change the outputs"


def test_rank_killed_mid_publish_leaves_the_version_and_is_named(engine: Any, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed when it reaches bucket 1: the engine had the manifest and bucket 0, drops the
    update (staged: nothing applied) and keeps serving its version; rank 0's error names rank 1 as dead."""
    import ray

    served = ray.get(engine.version.remote())
    before = generate(engine)
    codes, results, logs = run_ranks(_endpoint(engine), "kill", 2, tmp_path, timeout=240)
    assert codes[1] == -9 and codes[0] == 0, logs
    (res,) = results[0]
    assert res["version"] == 4 and not res["ok"] and res["error"] == "UpdateFailed", res
    (reason,) = res["reasons"].values()
    assert "RankFailed: trainer rank 1" in reason and "died before sending bucket 1" in reason, reason
    assert ray.get(engine.version.remote()) == served
    assert_same_outputs(generate(engine), before, tol=0.0)
    dropped = [r for r in ray.get(engine.records.remote()) if r["version"] == 4]
    assert dropped and not dropped[-1]["ok"] and "trainer rank 1" in dropped[-1]["reason"], dropped


def test_rank_claiming_another_ranks_bytes_fails_on_every_rank(engine: Any, tmp_path: Path) -> None:
    """Rank 1 declares rank 0's rows of model.norm.weight as its own: the ranks' agreement refuses it on
    every rank, naming both ranks, before any engine is told; the engine keeps its version."""
    import ray

    served = ray.get(engine.version.remote())
    codes, results, logs = run_ranks(_endpoint(engine), "steal", 2, tmp_path, timeout=240)
    assert codes == [0, 0], logs
    for res in results:
        (r,) = res
        assert (r["version"], r["ok"], r["error"], r["ranks"]) == (5, False, "ShardError", [0, 1]), r
        assert "model.norm.weight" in r["message"] and "sent by both rank 0 and rank 1" in r["message"], r
    assert ray.get(engine.version.remote()) == served


def test_a_range_whose_bytes_changed_is_refused_naming_its_rank(engine: Any, tmp_path: Path) -> None:
    """Rank 1's first range in bucket 0 has one bit flipped after it was summed: the engine's per-range check
    refuses the update naming tensor, bytes and rank 1; nothing is applied and every rank raises it."""
    import ray

    served = ray.get(engine.version.remote())
    codes, results, logs = run_ranks(_endpoint(engine), "corrupt", 2, tmp_path, timeout=240)
    assert codes == [0, 0], logs
    for res in results:
        (r,) = res
        assert (r["version"], r["ok"], r["error"]) == (6, False, "UpdateFailed"), r
        (reason,) = r["reasons"].values()
        assert "ChecksumError" in reason and "from rank 1: checksum mismatch" in reason, reason
    assert ray.get(engine.version.remote()) == served


def test_four_fsdp2_ranks_row_and_column_shards_publish_two_versions_equal_cold_load(engine: Any, tmp_path: Path) -> None:
    """Four ranks, the square weights (attention projections) ``Shard(1)`` through FSDP2's
    ``shard_placement_fn`` (strided ranges, re-laid by each rank's write into the segments) and the rest
    ``Shard(0)``, publish versions 7 (``build_model("tiny", 7)``) and 8 (times 0.5) after the failures above;
    the engine equals a cold load of version 8's full weights."""
    import ray

    from devtools.tiny_models import save_checkpoint

    before = generate(engine)
    codes, results, logs = run_ranks(_endpoint(engine), "versions", 4, tmp_path, first=7, shard="mixed")
    assert codes == [0, 0, 0, 0], logs
    full = full_weights(7, 0.5)
    assert assert_fsdp2_split(shard_geometry(tmp_path, 4), full) == {"Shard(0)", "Shard(1)"}
    for rank, res in enumerate(results):
        assert [(r["version"], r["ok"], r.get("verified")) for r in res] == [(7, True, [True]), (8, True, [True])], (rank, res, logs)
    assert ray.get(engine.version.remote()) == 8
    after = generate(engine)
    (cold,) = oracle([save_checkpoint(full, tmp_path / "v8")], 1, "bfloat16")
    assert_same_outputs(after, cold)
    assert [o["token_ids"] for o in after] != [o["token_ids"] for o in before], "the update did not change the outputs"


def test_fsdp2_ranks_with_deltas_equal_cold_load_and_read_back_bit_identical(engine: Any, tmp_path: Path) -> None:
    """``sync.delta`` on: two ranks (row and column shards) publish version 9 dense, then six versions of
    about 0.8% changed elements each as deltas (the fifth after another publisher's version 109, so it is
    refused as naming the wrong base and resent dense). The engine then equals a cold load of the last
    version's full weights, and the weights read back from it are the trainer's, bit for bit."""
    import ray

    from devtools.tiny_models import save_checkpoint
    from tests.ranks_worker import DELTA_STEPS, step
    from tests.test_delta_sync import read_back_equal

    codes, results, logs = run_ranks(_endpoint(engine), "deltas", 2, tmp_path, first=9, shard="mixed")
    assert codes == [0, 0], logs
    for res in results:
        assert [(r["version"], r["ok"]) for r in res] == [(v, True) for v in (9, 10, 11, 12, 13, 114, 115)], (res, logs)
        assert [r["delta"]["mode"] for r in res] == ["dense"] + ["delta"] * DELTA_STEPS, res
        assert [bool(r["fallback"][0]) for r in res] == [False] * 5 + [True, False], res
    assert ray.get(engine.version.remote()) == 115
    full = full_weights(9)
    for k in range(1, DELTA_STEPS + 1):
        step(full, k)
    read_back_equal(engine, full)
    (cold,) = oracle([save_checkpoint(full, tmp_path / "v115")], 1, "bfloat16")
    assert_same_outputs(generate(engine), cold)
