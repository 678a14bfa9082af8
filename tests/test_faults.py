"""Faults on the real engine (staged mode) never leave it serving a mix of versions: the trainer SIGKILLed
mid-stream, a connection cut and restored, two publishers racing, a TP worker raising inside the load
(degraded without a host copy, rolled back with one), the inference actor killed mid-update and brought
back by Ray.

After each fault the engine's outputs equal a cold-loaded engine of the version it reports. The
engine's first outputs (a fresh engine cold-loaded from v1's checkpoint) are the oracle of v1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bridge.report import FailureKind
from tests.fault_worker import FAULT_WORKER
from tests.helpers import ROOT, assert_same_outputs, child_env, free_port, generate, oracle, wait_until

pytestmark = pytest.mark.engine

# Tiny buckets (the tiny model makes ~40 of them) and short deadlines so faults are found in seconds.
CONFIG: dict[str, Any] = {
    # the plain dense stream (sync.delta off), whose packing slow_packing slows (trainer_side.publisher's
    # pack_bucket) so that a kill or cut lands mid-stream; deltas are faulted in tests/test_delta_updates.py
    "sync": {"delta": False},
    "transport": {"bucket_mb": 0.02, "depth": 2},
    "deadlines": {"connect_s": 10, "manifest_s": 10, "bucket_s": 3, "heartbeat_s": 0.5},
}
FAIL_AT = "model.layers.1.mlp.down_proj.weight"


def _config() -> Any:
    from bridge.config import config_from_dict

    return config_from_dict(CONFIG)


def _weights(seed: int) -> list[tuple[str, Any]]:
    from devtools.tiny_models import build_model

    return list(build_model("tiny", seed).named_parameters())


@contextmanager
def slow_packing(delay_s: float) -> Iterator[None]:
    """Slow the in-process publisher down between buckets so a fault lands mid-stream."""
    import trainer_side.publisher as publisher

    real = publisher.pack_bucket

    def slow(*args: Any, **kwargs: Any) -> list[int]:
        time.sleep(delay_s)
        return real(*args, **kwargs)

    publisher.pack_bucket = slow  # type: ignore[assignment]
    try:
        yield
    finally:
        publisher.pack_bucket = real  # type: ignore[assignment]


def open_session(actor: Any, version: int) -> dict[str, Any] | None:
    import ray

    return next((s for s in ray.get(actor.status.remote())["sessions"] if s["version"] == version), None)


def mid_stream(actor: Any, version: int, staged: int = 2) -> dict[str, Any]:
    """Wait until the engine holds a partial update of ``version``; return its session summary."""
    return wait_until(lambda: (s := open_session(actor, version)) and staged <= s["staged"] < s["buckets"] and s,
                      60, f"a partial update of v{version} on the engine")


def _publish_interrupted(pub: Any, weights: list[tuple[str, Any]], version: int, actor: Any,
                         interrupt: Callable[[], Any]) -> Any:
    """Publish on a thread with slowed packing, call ``interrupt`` once the engine holds part of the
    update, and return the UpdateFailed the publisher raised (it must not hang)."""
    from bridge.errors import UpdateFailed

    errors: list[UpdateFailed] = []

    def run() -> None:
        try:
            pub.publish(weights, version=version)
        except UpdateFailed as exc:
            errors.append(exc)

    with slow_packing(0.2):
        worker = threading.Thread(target=run)
        worker.start()
        mid_stream(actor, version)
        interrupt()
        worker.join(60)
    assert not worker.is_alive(), "publish hung after the interruption"
    assert len(errors) == 1, "publish did not fail after the interruption"
    return errors[0]


def actor_tree(actor: Any) -> tuple[int, set[int]]:
    import os

    import psutil
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    return pid, {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}


def receiver_segments(pid: int) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"wb-recv-*-{pid}-*"))


@pytest.fixture(scope="module")
def engine(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    actor = InferenceActor.options(max_restarts=1).remote(  # type: ignore[attr-defined]
        model=str(checkpoints("tiny", 1)), tensor_parallel_size=1, dtype="bfloat16", config=CONFIG, name="fault-engine",
        worker_extension_cls=FAULT_WORKER)
    ray_session.get(actor.endpoint.remote(), timeout=600)
    state = {"actor": actor, "v1_outputs": generate(actor)}
    oracle([checkpoints("tiny", 2), checkpoints("tiny", 3)], 1, "bfloat16")  # one cold-load process for both
    yield state
    try:
        ray_session.get(actor.shutdown.remote(), timeout=60)
    finally:
        ray_session.kill(state["actor"], no_restart=True)


def _served(actor: Any) -> tuple[int, str | None]:
    import ray

    st = ray.get(actor.status.remote())
    return st["version"], st["degraded"]


# ---- (a) trainer SIGKILLed mid-stream ----------------------------------------------------------

def test_trainer_sigkill_mid_stream(engine: Any, checkpoints: Any) -> None:
    import ray

    from trainer_side import WeightPublisher

    actor = engine["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    version, _ = _served(actor)
    pid, _tree = actor_tree(actor)
    before = generate(actor)
    cmd = [sys.executable, str(ROOT / "tests" / "slow_trainer.py"), endpoint, "tiny", "3", str(version + 1), "0.3",
           json.dumps(CONFIG)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env(), cwd=ROOT)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "PACKED 3":
                break
        session = mid_stream(actor, version + 1)
        proc.kill()  # SIGKILL: no Abort, no goodbye
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 0 < session["staged"] < session["buckets"], session
    assert generate(actor) == before, "the engine changed while an update was only partly received"
    # the receiver drops the dead trainer's session at the bucket deadline and frees its staging memory
    wait_until(lambda: open_session(actor, version + 1) is None, CONFIG["deadlines"]["bucket_s"] + 15,
               "the engine to abort the dead trainer's session")
    last = ray.get(actor.records.remote())[-1]
    assert last["version"] == version + 1 and not last["ok"], last
    assert last["reason"] == "timeout: no data for 3.0s", last
    assert receiver_segments(pid) == []
    assert _served(actor) == (version, None)
    after = generate(actor)
    assert after == before
    assert_same_outputs(after, engine["v1_outputs"])
    # the next complete version is accepted
    with WeightPublisher([endpoint], config=_config()) as pub:
        report = pub.publish(_weights(3), version=version + 1)
    assert report.ok and report.engines[0].verified, report
    assert _served(actor) == (version + 1, None)
    (cold,) = oracle([checkpoints("tiny", 3)], 1, "bfloat16")
    assert_same_outputs(generate(actor), cold)


# ---- (c) connection cut and restored -----------------------------------------------------------

class Proxy:
    """tests/tcpproxy.py as a process between the publisher and the engine."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "tcpproxy.py"), str(self.port), *map(str, self.target)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().startswith("LISTENING"), "proxy did not start"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_connection_cut_and_restored(engine: Any, checkpoints: Any) -> None:
    import ray

    from trainer_side import WeightPublisher

    actor = engine["actor"]
    version, _ = _served(actor)
    before = generate(actor)
    proxy = Proxy(ray.get(actor.endpoint.remote()))
    try:
        with WeightPublisher([proxy.endpoint], config=_config()) as pub:
            err = _publish_interrupted(pub, _weights(2), version + 1, actor, proxy.kill)  # the cut
            reason = err.reasons[proxy.endpoint]
            assert "DeadlineExceeded: bucket" in reason and "no answer within 3.0s" in reason, reason
            assert proxy.endpoint in str(err)
            wait_until(lambda: open_session(actor, version + 1) is None, 20, "the engine to drop the cut session")
            assert _served(actor) == (version, None)
            assert generate(actor) == before
            proxy.start()  # restored: ZMQ reconnects by itself; a later publish succeeds
            report = pub.publish(_weights(2), version=version + 2)
        assert report.ok and report.engines[0].verified, report
    finally:
        proxy.kill()
    assert _served(actor) == (version + 2, None)
    (cold,) = oracle([checkpoints("tiny", 2)], 1, "bfloat16")
    assert_same_outputs(generate(actor), cold)


# ---- (e) two publishers racing on one engine ---------------------------------------------------

def _race(endpoint: str, jobs: list[tuple[int, int]]) -> list[Any]:
    """Publish (seed, version) jobs concurrently from separate publishers; return report or error each."""
    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    results: list[Any] = [None] * len(jobs)
    weights = [_weights(seed) for seed, _ in jobs]
    barrier = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        with WeightPublisher([endpoint], config=_config(), name=f"racer-{i}") as pub:
            barrier.wait()
            try:
                results[i] = pub.publish(weights[i], version=jobs[i][1])
            except UpdateFailed as exc:
                results[i] = exc

    with slow_packing(0.02):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return results


def test_two_publishers_racing(engine: Any, checkpoints: Any) -> None:
    import ray

    from bridge.errors import UpdateFailed

    actor = engine["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    version, _ = _served(actor)
    n_records = len(ray.get(actor.records.remote()))
    # different versions: the newer one ends up served; the older one was applied first or refused
    low, high = _race(endpoint, [(2, version + 1), (3, version + 2)])
    assert not isinstance(high, UpdateFailed) and high.ok, high
    if isinstance(low, UpdateFailed):
        assert "VersionError" in str(low) and "served version" in str(low), low
    assert _served(actor) == (version + 2, None)
    oks = [r["version"] for r in ray.get(actor.records.remote())[n_records:] if r["ok"]]
    assert oks == sorted(oks) and oks[-1] == version + 2, oks
    cold2, cold3 = oracle([checkpoints("tiny", 2), checkpoints("tiny", 3)], 1, "bfloat16")
    assert_same_outputs(generate(actor), cold3)
    # the same version from both, with other weights: exactly one is applied; the other is refused, as not
    # newer (it was staged while the first applied) or as a conflict (its manifest came after): never a no-op
    same = version + 3
    results = _race(endpoint, [(2, same), (3, same)])
    applied = [i for i, r in enumerate(results) if not isinstance(r, UpdateFailed) and not r.engines[0].noop]
    assert len(applied) == 1, results
    other = results[1 - applied[0]]
    assert isinstance(other, UpdateFailed), other
    assert (("VersionError" in str(other) and f"version {same} is not newer" in str(other))
            or f"VersionConflict: version {same} is already served with different weights" in str(other)), other
    assert _served(actor) == (same, None)
    assert_same_outputs(generate(actor), [cold2, cold3][applied[0]])


# ---- (f) a TP worker raising inside the load: degraded without a host copy ---------------------

def test_worker_failure_without_host_copy_degrades_until_a_complete_version(engine: Any, checkpoints: Any) -> None:
    import ray

    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    actor = engine["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    version, _ = _served(actor)
    assert ray.get(actor.collective_rpc.remote("wb_arm_failure", (FAIL_AT,))) == [FAIL_AT]
    with WeightPublisher([endpoint], config=_config()) as pub:
        with pytest.raises(UpdateFailed) as info:
            pub.publish(_weights(2), version=version + 1)
        reason = info.value.reasons[endpoint]
        assert info.value.kinds[endpoint] == FailureKind.LOAD, info.value.kinds
        assert reason == f"rank 0: RuntimeError: test-only injected failure while loading {FAIL_AT}", reason
        served, degraded = _served(actor)
        assert served == version  # loading had begun: the version did not advance ...
        assert degraded and f"update to v{version + 1} failed after loading began" in degraded
        with pytest.raises(ray.exceptions.RayTaskError, match="is degraded"):  # ... and nothing is served
            generate(actor)
        # a complete version lifts it
        report = pub.publish(_weights(2), version=version + 1)
    assert report.ok and report.engines[0].verified, report
    assert _served(actor) == (version + 1, None)
    (cold,) = oracle([checkpoints("tiny", 2)], 1, "bfloat16")
    assert_same_outputs(generate(actor), cold)


# ---- (b) the inference actor killed mid-update ---------------------------------------------------

def test_actor_killed_mid_update_comes_back_through_ray(engine: Any, checkpoints: Any) -> None:
    """Decision: a restarted actor cold-loads the checkpoint it was created with and reports version 0
    (that checkpoint), on a new endpoint; publishers must be pointed at ``actor.endpoint()`` again."""
    import psutil
    import ray

    from trainer_side import WeightPublisher

    actor = engine["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    version, _ = _served(actor)
    if version == 0:  # run alone: first serve a version that came over the wire
        with WeightPublisher([endpoint], config=_config()) as pub:
            assert pub.publish(_weights(2), version=1).ok
        version = 1
    pid, old_tree = actor_tree(actor)
    with WeightPublisher([endpoint], config=_config()) as pub:
        err = _publish_interrupted(pub, _weights(3), version + 1, actor, lambda: ray.kill(actor, no_restart=False))
    assert endpoint in err.reasons, err
    assert f"{endpoint}: DeadlineExceeded: bucket" in str(err), err
    leaked = receiver_segments(pid)  # the killed receiver's staging: SIGKILL unlinks nothing
    assert leaked, "the killed actor left no receive segments: nothing for the restarted one to sweep"
    # Ray restarts the actor (max_restarts=1): it cold-loads v1 and says so
    deadline = time.monotonic() + 600
    while True:
        try:
            served = ray.get(actor.version.remote(), timeout=600)
            break
        except ray.exceptions.ActorUnavailableError:  # "the actor is restarting"
            assert time.monotonic() < deadline, "Ray did not restart the actor"
            time.sleep(0.5)
    assert served == 0
    assert receiver_segments(pid) == [], "the restarted actor did not sweep its predecessor's receive segments"
    status = ray.get(actor.status.remote())
    assert status["degraded"] is None and status["sessions"] == []
    assert_same_outputs(generate(actor), engine["v1_outputs"])
    # the old engine's processes are gone, none orphaned
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in old_tree), 60, f"the killed actor's processes {sorted(old_tree)} to exit")
    new_endpoint = ray.get(actor.endpoint.remote())
    with WeightPublisher([new_endpoint], config=_config()) as pub:
        report = pub.publish(_weights(3), version=version + 1)
    assert report.ok and report.engines[0].verified, report
    assert _served(actor) == (version + 1, None)
    (cold,) = oracle([checkpoints("tiny", 3)], 1, "bfloat16")
    assert_same_outputs(generate(actor), cold)


# ---- (f) with sync.host_copy: all TP ranks fail the same way, the previous version is restored ---

@pytest.fixture(scope="module")
def hc_engine(ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    cfg = dict(CONFIG, sync={"host_copy": True})
    actor = InferenceActor.remote(model=str(checkpoints("tiny", 1)), tensor_parallel_size=2, dtype="bfloat16",
                                  config=cfg, name="host-copy-engine", worker_extension_cls=FAULT_WORKER)
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield actor
    ray_session.get(actor.shutdown.remote(), timeout=60)
    ray_session.kill(actor)


def test_worker_failure_with_host_copy_rolls_back_tp2(hc_engine: Any, checkpoints: Any) -> None:
    import ray

    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    actor = hc_engine
    endpoint = ray.get(actor.endpoint.remote())
    assert ray.get(actor.status.remote())["host_copy"] is True
    with WeightPublisher([endpoint], config=_config()) as pub:
        assert pub.publish(_weights(2), version=2).ok  # the host copy now holds v2 (received over the wire)
        v2 = generate(actor)
        assert ray.get(actor.collective_rpc.remote("wb_arm_failure", (FAIL_AT,))) == [FAIL_AT, FAIL_AT]
        with pytest.raises(UpdateFailed) as info:
            pub.publish(_weights(3), version=3)
        reason = info.value.reasons[endpoint]
        assert info.value.kinds[endpoint] == FailureKind.LOAD, info.value.kinds
        failure = f"RuntimeError: test-only injected failure while loading {FAIL_AT}"
        assert reason == (f"rank 0: {failure} | rank 1: {failure} "
                          "(rolled back from the host copy: the engine serves version 2)"), reason
        assert len(info.value.reasons) == 1  # one error for the one engine
        assert _served(actor) == (2, None)
        assert generate(actor) == v2
        (cold,) = oracle([checkpoints("tiny", 2)], 2, "bfloat16")
        assert_same_outputs(v2, cold)
        report = pub.publish(_weights(3), version=3)  # and the next complete version goes in
    assert report.ok and report.engines[0].verified
    assert _served(actor) == (3, None)
    assert [(o["token_ids"], o["logprobs"]) for o in generate(actor)] != [(o["token_ids"], o["logprobs"]) for o in v2]
