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
