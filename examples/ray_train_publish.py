"""Publishing from every rank of a Ray Train trainer: ``ray.train.torch.TorchTrainer`` with N CPU workers
(Ray Train sets up their gloo process group), tiny Qwen2 under FSDP2 ``fully_shard``, each worker sending
only its own shards (``trainer_side.multi_rank.RankedPublisher``) to the ``InferenceActor``s it finds by
name. ``DTensor.full_tensor`` is made to raise in the workers, so a gather anywhere would fail the run.

Run it in a private local Ray cluster (started by the script, gone when it ends), or with ``RAY_ADDRESS`` set
to a cluster of your own::

    RAY_ADDRESS=local python examples/ray_train_publish.py --workers 2 --steps 2

It starts one engine (``InferenceActor`` named ``wb-train-engine``), runs the trainer, and prints one JSON
line per version rank 0 published (bytes, seconds, verified) and the engine's greedy tokens after it.
``train(...)`` is the same run for a caller that already holds a Ray session and engines
(tests/test_ray_train.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
BRIDGE = {"transport": {"kind": "zmq", "bucket_mb": 0.25}, "deadlines": {"bucket_s": 120, "manifest_s": 120}}
ENGINE = "wb-train-engine"
PROMPT = [1, 2, 3, 4, 5]


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: its shards of ``build_model("tiny", seed)``, published as versions
    ``first .. first + steps - 1`` to the engines named in ``config["engines"]``; each step after the first
    scales them by ``config["scale"]`` first (the local shards only: a stand-in for an optimizer step)."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from bridge.config import config_from_dict
    from bridge.errors import BridgeError
    from devtools.tiny_models import build_model
    from trainer_side.multi_rank import RankedPublisher

    def no_gather(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a rank gathered a full tensor")

    DTensor.full_tensor = no_gather  # type: ignore[method-assign]
    DTensor.redistribute = no_gather  # type: ignore[method-assign]
    rank, world = dist.get_rank(), dist.get_world_size()  # Ray Train's gloo group
    mesh = init_device_mesh("cpu", (world,))
    model = build_model("tiny", seed=config["seed"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    actors = [ray.get_actor(name, namespace=config.get("namespace")) for name in config["engines"]]
    endpoints = [str(ray.get(actor.endpoint.remote(), timeout=60)) for actor in actors]
    results: list[dict[str, Any]] = []
    with RankedPublisher(endpoints, config=config_from_dict(config.get("bridge", BRIDGE))) as publisher:
        for step in range(config["steps"]):
            version = config["first"] + step
            if step:
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().mul_(config["scale"])  # this rank's shard only
            try:
                report = publisher.publish(model.state_dict(), version=version)
                results.append({"version": version, "ok": True, "bytes": report.bytes,
                                "seconds": round(report.seconds["total"], 3),
                                "verified": [e.verified for e in report.engines]})
            except BridgeError as exc:
                results.append({"version": version, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
                break
    metrics = {"rank": rank, "world": world, "results": results}
    if rank == 0:  # Ray Train keeps what a checkpoint carries: rank 0's results travel in one
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "results.json").write_text(json.dumps(metrics))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    else:
        ray.train.report(metrics)


def train(engines: list[str], workers: int, steps: int, storage: Path, first: int = 1, seed: int = 2,
          scale: float = 0.5, cpus_per_worker: float = 1.0, bridge: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``train_loop`` on ``workers`` Ray Train CPU workers against the named engines (in this job's Ray
    namespace); rank 0's last report: ``{"rank", "world", "results": [per version]}``."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"engines": engines, "namespace": ray.get_runtime_context().namespace, "steps": steps,
                           "first": first, "seed": seed, "scale": scale, "bridge": bridge or BRIDGE},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(name="wb-ray-train", storage_path=str(storage)),
    )
    result = trainer.fit()
    assert result.checkpoint is not None, "rank 0 reported no results"
    with result.checkpoint.as_directory() as path:
        return dict(json.loads((Path(path) / "results.json").read_text()))


def main() -> None:
    import ray

    from devtools.tiny_models import make_checkpoint
    from inference_side import InferenceActor

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/wb-ray-train"))
    args = parser.parse_args()
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, log_to_driver=False)
    ckpt = make_checkpoint("tiny", args.out / "v0", seed=1)
    actor = InferenceActor.options(name=ENGINE).remote(model=str(ckpt), tensor_parallel_size=1,  # type: ignore[attr-defined]
                                                       dtype="bfloat16")
    try:
        ray.get(actor.endpoint.remote(), timeout=600)
        metrics = train([ENGINE], args.workers, args.steps, args.out / "ray")
        for line in metrics["results"]:
            print(json.dumps({**line, "ranks": metrics["world"]}), flush=True)
        (out,) = ray.get(actor.generate.remote([PROMPT], max_tokens=6))
        print(f"engine serves v{ray.get(actor.version.remote())}: {out['token_ids']}", flush=True)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
        ray.shutdown()


if __name__ == "__main__":
    main()
