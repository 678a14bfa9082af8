"""serve.worker_idle_spin_s at its lowest level: the message-queue readers of this process are found and
shortened, the writer is left alone, and the search survives what gc hands back (dead weak proxies).
The engine-level check (an idle TP worker stops spinning) is in tests/test_transports.py."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

pytest.importorskip("vllm")


def test_readers_are_shortened_writers_untouched_and_dead_proxies_skipped(tmp_path: Path) -> None:
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from inference_side.idle_spin import set_reader_spin

    class Gone:
        pass

    target = Gone()
    dead = [weakref.proxy(target)]  # a container gc tracks, holding a proxy whose referent is about to go
    del target
    with pytest.raises(ReferenceError):
        isinstance(dead[0], SpinCondition)  # what a plain isinstance scan would trip on
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
    try:
        assert reader.busy_loop_s == 1  # vLLM's value
        previous = set_reader_spin(0.05)
        assert 1 in previous
        assert reader.busy_loop_s == 0.05 and writer.busy_loop_s == 0
    finally:
        for cond in (reader, writer):
            for name in ("local_notify_socket", "read_cancel_socket", "write_cancel_socket"):
                sock = getattr(cond, name, None)
                if sock is not None:
                    sock.close(linger=0)
        ctx.term()


ENGINE_CORE_PROBE = r"""
import json, multiprocessing, os, sys, time
import zmq
from bridge.vllm_plugin import ENGINE_CORE_SPIN_ENV, register
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

register()  # what vLLM does in each process it starts
ctx = zmq.Context()
made = []

def reader(name):
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=f"ipc://{sys.argv[1]}/{name}")
    cond = SpinCondition(is_reader=True, context=ctx, notify_address=f"ipc://{sys.argv[1]}/{name}")
    made.extend((writer, cond))
    cond.last_read = 0.0  # idle: the next wait sleeps until notified (none comes here) or rechecked
    t0 = time.monotonic()
    cond.wait(timeout_ms=3000 if os.environ.get(ENGINE_CORE_SPIN_ENV) else 400)
    return {"busy_loop_s": cond.busy_loop_s, "writer": writer.busy_loop_s, "slept": time.monotonic() - t0}

out = {"core": reader("core")}
multiprocessing.current_process().name = "VllmWorker-0"  # as vLLM names a TP worker's process
out["worker"] = reader("worker")
os.environ.pop(ENGINE_CORE_SPIN_ENV, None)
multiprocessing.current_process().name = "MainProcess"
out["unset"] = reader("unset")
for cond in made:
    for name in ("local_notify_socket", "read_cancel_socket", "write_cancel_socket"):
        sock = getattr(cond, name, None)
        if sock is not None:
            sock.close(linger=0)
ctx.term()
print(json.dumps(out))
"""


@pytest.mark.parametrize("value", ["0", "0.005", "vllm"])
def test_engine_core_spin_from_the_environment(tmp_path: Path, value: str) -> None:
    """WEIGHT_BRIDGE_ENGINE_CORE_SPIN_S (serve.engine_core_spin_s, set by InferenceServer while its engine starts)
    in a fresh process: readers made outside a TP worker spin that long, a worker's keep vLLM's 1 s
    (serve.worker_idle_spin_s sets them); every reader made while it is set wakes within RECHECK_MS even when
    no notification comes (vLLM's sleeps to its timeout, 3 s here, 5 s at most: its bound for a lost one); readers made once it is
    unset are vLLM's. ``vllm`` keeps every spin and only shortens the recheck (a GPU engine core whose
    workers' spin serve.worker_idle_spin_s shortened)."""
    import json
    import subprocess
    import sys

    from bridge.vllm_plugin import ENGINE_CORE_SPIN_ENV, RECHECK_MS
    from tests.helpers import child_env

    done = subprocess.run([sys.executable, "-c", ENGINE_CORE_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=child_env(**{ENGINE_CORE_SPIN_ENV: value}))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["core"]["busy_loop_s"] == (1 if value == "vllm" else float(value)) and out["core"]["writer"] == 0, out
    assert out["worker"]["busy_loop_s"] == 1, out
    for who in ("core", "worker"):
        assert out[who]["slept"] < 0.5, f"{who}: an idle wait with no notification slept {out[who]['slept']:.3f}s (recheck {RECHECK_MS} ms)"
    assert out["unset"]["busy_loop_s"] == 1 and out["unset"]["slept"] >= 0.35, out  # vLLM's own wait: the full 400 ms
