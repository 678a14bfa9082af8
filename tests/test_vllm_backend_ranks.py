"""The ``weight_bridge`` trainer engine of vLLM's weight-transfer API from many trainer ranks: a real ``vllm serve``
(tiny Qwen2, TP 1, the ``weight_bridge`` backend) and two real torchrun ranks (gloo, FSDP2 ``fully_shard``,
``DTensor.full_tensor`` and ``redistribute`` made to raise in them: tests/vllm_ranks_worker.py), each building
the trainer engine with ``trainer_ranks=2`` and calling ``send_weights()`` with its own shards (``ShardSource``) over
ZMQ while rank 0 alone drives vLLM's client over HTTP. One torchrun run, asserted in parts: two versions served
equal to an engine cold-loaded from the full weights (built unsharded here), every rank returning the same report;
a rank whose own part fails makes every rank raise the same error naming it, the server keeping the previous
version, and the next call applies; a rank whose process ends mid-publish is named in rank 0's error and the server
keeps serving its version."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import assert_same_outputs, free_port_in, oracle, vllm_serve
from tests.ranks import full_weights, torchrun

pytestmark = pytest.mark.engine
PORTS = range(26200, 26300)  # this module's: the server, the workers' receivers, the ranks' MASTER_PORT


def _free_ports(n: int) -> list[int]:
    found: list[int] = []
    while len(found) < n:
        port = free_port_in(range(found[-1] + 1 if found else PORTS.start, PORTS.stop))
        if port is None:
            raise AssertionError(f"fewer than {n} free ports in {PORTS.start}-{PORTS.stop - 1}")
        found.append(port)
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any) -> dict[str, Any]:
    """The server, then one torchrun of two ranks against it: each rank's results, torchrun's exit code and log."""
    from devtools.tiny_models import build_model, save_checkpoint, save_word_tokenizer

    model = build_model("tiny", seed=1)
    ckpt = save_checkpoint(model, tmp_path_factory.mktemp("serve-tiny"))
    save_word_tokenizer(ckpt, model.config.vocab_size)
    http, base_port = _free_ports(2)
    out = tmp_path_factory.mktemp("ranks")
    with vllm_serve(ckpt, http, tmp_path_factory.mktemp("serve-log") / "server.log") as url:
        # each torchrun's master port is picked as late as possible: the range lies among the ephemeral ports, which
        # any connection may take
        code, log = _torchrun(url, base_port, out)
        # a second torchrun against the same server, sync.delta on
        deltas = tmp_path_factory.mktemp("ranks-deltas")
        delta_code, delta_log = _torchrun(url, base_port, deltas, "deltas")
    ranks = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else [] for r in range(2)]
    delta_ranks = [json.loads(p.read_text()) if (p := deltas / f"rank{r}.json").exists() else [] for r in range(2)]
    return {"code": code, "log": log[-6000:], "ranks": ranks, "dir": out,
            "deltas": {"code": delta_code, "log": delta_log[-6000:], "ranks": delta_ranks}}


def _torchrun(url: str, base_port: int, out: Any, *mode: str) -> tuple[int, str]:
    """Two ranks of tests/vllm_ranks_worker.py against the server at ``url``: torchrun's exit code and log."""
    master = next(p for p in _free_ports(3) if p not in (int(url.rsplit(":", 1)[1]), base_port))
    return torchrun([url, str(base_port), str(out), *mode], master)


@pytest.fixture(scope="module")
def cold(run: dict[str, Any]) -> dict[float, Any]:
    """scale -> the outputs of an engine cold-loaded from the full weights the ranks published at that scale (of
    ``build_model("tiny", 2)``: versions 1, 2 and 3), built unsharded here; 0.0 -> those of the deltas run's last
    version."""
    from devtools.tiny_models import save_checkpoint
    from tests.ranks_worker import step

    scales = (1.0, 0.5, 0.25)
    ckpts = [save_checkpoint(full_weights(2, scale), run["dir"] / f"full-x{scale}") for scale in scales]
    stepped = full_weights(2, 0.25)  # the deltas run's last version (key 0.0)
    for k in (1, 2):
        step(stepped, k)
    ckpts.append(save_checkpoint(stepped, run["dir"] / "full-deltas"))
    return dict(zip((*scales, 0.0), oracle(ckpts, 1, "bfloat16"), strict=True))


def test_two_fsdp2_ranks_send_two_versions_equal_to_a_cold_load(run: dict[str, Any], cold: dict[float, Any]) -> None:
    assert run["code"] == 0, run["log"]
    zero, one = run["ranks"]
    assert [r["version"] for r in zero] == [1, 2, 3, 3, 4], (zero, run["log"])
    for r in (zero[0], zero[1], one[0], one[1]):  # every rank returns the same report
        assert (r["ok"], r["verified"]) == (True, [True]), r
    assert [(r["bytes"], r["trainer_version"]) for r in zero[:2]] == [(r["bytes"], r["trainer_version"]) for r in one[:2]]
    assert [r["trainer_version"] for r in zero[:2]] == [1, 2]
    for result, want in zip(zero[:2], (cold[1.0], cold[0.5]), strict=True):
        assert result["served"]["weight_version"] == str(result["version"])
        assert_same_outputs(result["served"]["outputs"], want)
    assert zero[0]["served"]["outputs"] != zero[1]["served"]["outputs"], "version 2 did not change the outputs"


def test_a_rank_whose_part_fails_fails_every_rank_alike_and_the_next_call_applies(run: dict[str, Any],
                                                                                   cold: dict[float, Any]) -> None:
    """Rank 1's own part of version 3 raises at bucket 1: both ranks raise the same ``UpdateFailed`` naming rank 1
    (vLLM's own answer to ``update_weights`` beside it), stay on version 2, and the server serves exactly version 2;
    the next ``send_weights()`` (version 3 again) applies on both ranks and equals a cold load."""
    zero, one = run["ranks"]
    failed, again = zero[2], zero[3]
    assert not failed["ok"] and failed["error"] == "UpdateFailed", failed
    assert "trainer rank 1 failed before sending bucket 1 of version 3" in failed["message"], failed
    assert "the test's fault" in failed["message"], failed
    # the workers ended update_weights on the publisher's Abort, not on their deadline
    answered = failed["reasons"]["update_weights"]
    assert answered.startswith("HTTP 5") and "not applied [aborted]: trainer rank 1" in answered, answered
    assert {k: one[2][k] for k in ("ok", "error", "message", "reasons")} == \
        {k: failed[k] for k in ("ok", "error", "message", "reasons")}, (one[2], failed)
    assert failed["trainer_version"] == one[2]["trainer_version"] == 2
    assert failed["served"]["weight_version"] == "2"
    assert_same_outputs(failed["served"]["outputs"], zero[1]["served"]["outputs"], tol=0.0)
    assert again["ok"] and one[3]["ok"] and again["trainer_version"] == one[3]["trainer_version"] == 3, (again, one[3])
    assert again["served"]["weight_version"] == "3"
    assert_same_outputs(again["served"]["outputs"], cold[0.25])


def test_a_rank_that_dies_mid_publish_is_named_and_the_server_keeps_its_version(run: dict[str, Any]) -> None:
    zero, one = run["ranks"]
    assert len(one) == 4, one  # rank 1 ended inside version 4's publish
    died = zero[4]
    assert not died["ok"] and died["error"] == "UpdateFailed", died
    assert "trainer rank 1 (pid" in died["message"] and "died before sending bucket 1 of version 4" in died["message"], died
    assert died["trainer_version"] == 3 and died["served"]["weight_version"] == "3"
    assert_same_outputs(died["served"]["outputs"], zero[3]["served"]["outputs"], tol=0.0)


def test_with_deltas_the_ranks_send_deltas_through_vllms_api_equal_to_a_cold_load(run: dict[str, Any],
                                                                                 cold: dict[float, Any]) -> None:
    """A second torchrun with ``sync.delta`` on: the ranks assemble each version on rank 0's host, the first goes
    dense (no base yet) and the next two as deltas; every rank returns the same report, and what the server serves
    after the last equals a cold load of its full weights."""
    got = run["deltas"]
    assert got["code"] == 0, got["log"]
    zero, one = got["ranks"]
    sent = [(r["ok"], r.get("mode")) for r in zero]
    assert sent == [(True, "dense"), (True, "delta"), (True, "delta"), (False, None), (True, "delta")], (zero, got["log"])
    assert [(r["version"], r["ok"], r.get("mode"), r.get("bytes")) for r in zero] == \
        [(r["version"], r["ok"], r.get("mode"), r.get("bytes")) for r in one]
    assert all(r["ratio"] < 0.05 for r in zero[1:3]), [r.get("ratio") for r in zero]  # wire bytes against dense
    last = zero[-1]
    assert last["version"] == 13 and last["served"]["weight_version"] == "13"
    assert_same_outputs(last["served"]["outputs"], cold[0.0])


def test_a_rank_failing_while_rank_0_assembles_fails_before_vllm_is_asked_and_the_retry_applies(
        run: dict[str, Any]) -> None:
    """With deltas on, rank 1's ranges of bucket 0 fail while rank 0 assembles version 13: rank 0 opens vLLM's
    update session only once the model is assembled, so nothing was asked of the server (no ``update_weights``
    waiting out its 120 s deadline, no pause); both ranks raise the same ``RankFailed`` naming rank 1 (no engine
    heard of the version), the server keeps serving version 12, and the same weights sent again apply."""
    zero, one = run["deltas"]["ranks"]
    failed = zero[3]
    assert failed["version"] == 13 and not failed["ok"] and failed["error"] == "RankFailed", failed
    assert "trainer rank 1 failed before sending bucket 0 of version 13" in failed["message"], failed
    assert "the test's fault" in failed["message"], failed
    assert failed["reasons"] == {} and failed["seconds"] < 60, failed  # no update_weights answer: none was asked
    assert {k: one[3][k] for k in ("ok", "error", "message", "reasons")} == \
        {k: failed[k] for k in ("ok", "error", "message", "reasons")}, (one[3], failed)
    assert failed["trainer_version"] == one[3]["trainer_version"] == 12
    assert failed["served"]["weight_version"] == "12"
    assert_same_outputs(failed["served"]["outputs"], zero[2]["served"]["outputs"], tol=0.0)
    again = zero[4]
    assert again["ok"] and one[4]["ok"] and again["trainer_version"] == one[4]["trainer_version"] == 13, (again, one[4])
