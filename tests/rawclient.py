"""A raw ZMQ peer for hostile-input tests: sends exactly the frames a test builds."""

from __future__ import annotations

import time
from typing import Any

import zmq

from bridge import wire


class RawClient:
    def __init__(self, endpoint: str, identity: bytes = b"raw-test") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes | wire.Message) -> None:
        self.sock.send_multipart([f if isinstance(f, bytes | memoryview) else wire.encode(f) for f in frames])

    def until(self, kind: type, timeout: float = 60.0) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.sock.poll(100):
                msg = wire.decode(self.sock.recv_multipart()[0])
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind.__name__} within {timeout}s")

    def close(self) -> None:
        self.sock.close(0)
