"""One trainer rank of tests/test_vllm_backend_ranks.py, started by torchrun (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` from its environment): tiny Qwen2 under FSDP2 ``fully_shard`` over gloo on CPU
(``DTensor.full_tensor`` and ``redistribute`` made to raise in this process), and the ``weight_bridge`` trainer
engine of vLLM's weight-transfer API built on every rank with ``trainer_ranks=WORLD_SIZE`` and
``ShardSource(model)`` against the ``vllm serve`` at URL. Every rank calls ``send_weights()``, in order:

1. version 1: ``build_model("tiny", 2)``;
2. version 2: version 1's weights times 0.5 (computed on the local shards);
3. version 3: version 2's weights times 0.5; rank 1's own part fails at bucket 1 (a test-side patch of its
   publisher's write raises once);
4. version 3 again, the same weights: applied;
5. version 4 (the same weights): rank 1's process ends (``os._exit(0)``, so torchrun lets rank 0 run on) when it
   reaches bucket 1, a second after reporting bucket 0.

With a fourth argument ``deltas`` (a second torchrun against the same server) the ranks build the trainer engine
with ``sync.delta`` on (``first_version=10``: the server serves version 3) and send versions 10, 11 and 12:
version 3's weights (``build_model("tiny", 2)`` times 0.25;
dense, as the publisher has no base yet), then two of about 0.8% changed elements each
(``tests.ranks_worker.step``), as deltas; then version 13 twice with the same weights, rank 1's own part failing
at bucket 0 the first time (while rank 0 assembles the model, before any Begin went out).

Each rank writes what each call returned to ``OUT/rank{R}.json`` as it goes; rank 0 adds what the server serves
after each call (``/weight_info`` and greedy completions of ``tests.helpers.PROMPTS``).

With ``adapter TP LORA_DIR`` instead, the ranks send a LoRA adapter (``send_adapter_from_ranks``).

Run: torchrun --nproc-per-node 2 tests/vllm_ranks_worker.py URL BASE_PORT OUT [deltas | adapter TP LORA_DIR]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# bucket_s far above the test's own deadlines: a dead rank must be found dead, not timed out; deltas off (the
# faults are those of the sharded data plane) but in the ``deltas`` run
CONFIG = {"transport": {"kind": "zmq", "bucket_mb": 0.25}, "deadlines": {"bucket_s": 300, "manifest_s": 120},
          "sync": {"delta": False}}


def served(url: str) -> dict[str, Any]:
    """What the server serves now: its weight version and greedy completions (token ids, logprobs)."""
    import requests

    from tests.helpers import PROMPTS

    model = requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    outputs = []
    for prompt in PROMPTS:
        r = requests.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        outputs.append({"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]})
    return {"weight_version": requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"],
            "outputs": outputs}


def send_adapter_from_ranks(url: str, base_port: int, out: Path, tp: int, lora_dir: str) -> None:
    """``adapter`` mode: the trainer engine with ``trainer_ranks=WORLD_SIZE`` (``tp``: the server's TP size,
    ``lora_dir``: where its workers write what they verified) sends LoRA adapter ``ranks`` versions 1 and 2
    (tests/test_lora.py's tensors of seeds 11 and 12), each rank its chunks as DTensors (``lora_A`` column
    shards, ``lora_B`` row shards), with ``send_adapter`` on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from bridge.errors import BridgeError
    from tests.ranks_worker import adapter_chunks
    from tests.test_lora import adapter_spec
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=rank, trainer_ranks=world, base_port=base_port, tp_size=tp, lora_dir=lora_dir,
                             config=CONFIG, update_timeout_s=120),
        client=HTTPVLLMWeightSyncClient(url), source=None)
    results: list[dict[str, Any]] = []
    for version, seed in ((1, 11), (2, 12)):
        try:
            answer = trainer.send_adapter(adapter_chunks(seed, mesh), adapter_spec(name="ranks"))
            results.append({"version": version, "ok": True, "answer": answer,
                            "held": trainer.adapter_versions.get("ranks")})
        except BridgeError as exc:
            results.append({"version": version, "ok": False, "error": type(exc).__name__, "message": str(exc)})
        (out / f"rank{rank}.json").write_text(json.dumps(results))
    trainer.shutdown()


def main(url: str, base_port: int, out: Path, mode: str = "faults") -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import trainer_side.multi_rank as multi_rank
    from bridge.errors import BridgeError
    from tests.ranks_worker import sharded_model
    from trainer_side.vllm_backend import ShardSource, WeightBridgeInitInfo

    dist.init_process_group("gloo")  # rank, world and rendezvous from torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a rank gathered a full tensor")

    DTensor.full_tensor = refuse  # type: ignore[method-assign]
    DTensor.redistribute = refuse  # type: ignore[method-assign]
    model = sharded_model(2, init_device_mesh("cpu", (world,)))
    config = {**CONFIG, "sync": {"delta": True}} if mode == "deltas" else CONFIG
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeInitInfo(rank=rank, trainer_ranks=world, base_port=base_port, config=config,
                             first_version=10 if mode == "deltas" else 1,
                             update_timeout_s=120),
        client=HTTPVLLMWeightSyncClient(url), source=ShardSource(model))
    results: list[dict[str, Any]] = []

    def send(version: int) -> None:
        """``send_weights()`` with the default version (the one after the last applied): ``version``."""
        assert trainer.version + 1 == version, (trainer.version, version)
        t0 = time.monotonic()
        try:
            trainer.send_weights()
            report = trainer.last_report
            assert report is not None
            result: dict[str, Any] = {"version": version, "ok": True, "bytes": report.bytes,
                                      "verified": [e.verified for e in report.engines], "mode": report.delta.get("mode", ""),
                                      "ratio": report.delta.get("ratio", 1.0)}
        except BridgeError as exc:
            result = {"version": version, "ok": False, "error": type(exc).__name__, "message": str(exc),
                      "reasons": getattr(exc, "reasons", {})}
        result["trainer_version"] = trainer.version
        result["seconds"] = time.monotonic() - t0
        if rank == 0:
            result["served"] = served(url)
        results.append(result)
        (out / f"rank{rank}.json").write_text(json.dumps(results))

    def scale(factor: float) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(factor)  # this rank's shard only

    write = multi_rank.RankedPublisher._write

    def patched(fault: str, at: int = 1) -> Any:
        def faulty_write(self: Any, index: int, *args: Any, **kwargs: Any) -> Any:
            if index == at:
                multi_rank.RankedPublisher._write = write  # type: ignore[method-assign]  # once
                if fault == "exit":
                    time.sleep(1.0)  # its report of bucket 0 leaves the socket first
                    os._exit(0)
                raise BridgeError(f"rank 1 could not pack its share of bucket {at} (the test's fault)")
            return write(self, index, *args, **kwargs)

        return faulty_write

    if mode == "deltas":
        from tests.ranks_worker import step

        scale(0.25)
        first = trainer.version + 1
        send(first)
        for k in (1, 2):
            step(model, k)
            send(first + k)
        if rank == 1:  # its ranges of bucket 0 fail while rank 0 assembles the model: before any Begin went out
            multi_rank.RankedPublisher._write = patched("raise", at=0)  # type: ignore[method-assign]
        send(first + 3)
        send(first + 3)  # the same weights again
        trainer.shutdown()
        return
    send(1)
    scale(0.5)
    send(2)
    scale(0.5)
    if rank == 1:
        multi_rank.RankedPublisher._write = patched("raise")  # type: ignore[method-assign]
    send(3)
    send(3)
    if rank == 1:
        multi_rank.RankedPublisher._write = patched("exit")  # type: ignore[method-assign]
    send(4)
    trainer.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[4:5] == ["adapter"]:
        send_adapter_from_ranks(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[5]), sys.argv[6])
    else:
        main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5])
