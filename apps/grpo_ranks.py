"""The GRPO toy loop (apps/grpo_toy.py) with a trainer that spans ``--trainer-ranks N`` processes.

The policy is sharded with FSDP2 ``fully_shard`` (every decoder layer, then the root) over the N ranks of a gloo
process group; each rank holds only its shards. One step, on every rank:

  1. rollouts: rank 0 samples the whole batch from the engine(s) (split across engines as in the single-process
     loop) and scatters it: rank r gets the groups of its contiguous share of the prompts (``shares``), whole
     GRPO groups, so each rank computes its own advantages;
  2. update: data parallel. Each rank's loss is its share of the batch-mean policy-gradient loss (its sequences'
     sum over the global batch size, times N), FSDP2 averages the gradients over the ranks (reduce-scatter), so
     the step equals the single-process one on the whole batch; Adam steps each rank's shards;
  3. publish: every rank calls ``RankedPublisher.publish`` with its own ``state_dict()`` (FSDP2 DTensor shards)
     and the parity probe (a forward of the sharded policy on every rank, rank 0's logprobs are sent); no rank
     gathers a tensor it does not hold. The transport is the config's ``transport.kind``: ``shm`` (engines on the
     ranks' host) or ``zmq``.

Every rank yields the same log line per step (reward, loss and the rollout mismatch summed over the ranks with one
``all_reduce``); the launchers print rank 0's.

Launchers: ``torchrun_main`` (``torchrun --nproc-per-node N examples/grpo_toy.py --trainer-ranks N``: rank 0
starts the engine as a named Ray actor in its own local Ray, or in ``--ray-address``'s, and broadcasts its
endpoint; only rank 0 talks to Ray) and ``run_ray_train`` (``python -m apps.ray_job --loop grpo --trainer-ranks N``
as a Ray job: the driver starts the engines on its node and a Ray Train ``TorchTrainer`` of N CPU workers, gloo,
placed ``STRICT_PACK`` so they share one node, as the publisher's host-local control channel needs; rank 0 sends
each step's line to the driver through a Ray queue and the driver prints it).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from bridge.errors import BridgeError, ConfigError

logger = logging.getLogger(__name__)

GLOO_TIMEOUT = timedelta(minutes=30)  # the ranks' collectives (rank 0 starting the engine included)


class RanksError(BridgeError):
    """A multi-rank GRPO run cannot go on: rank 0 failed to start the engine or to sample, or the ranks were not
    launched as asked."""


def shard_policy(policy: Any, group: Any = None) -> Any:
    """``policy`` sharded in place with FSDP2 over the ranks of ``group`` (default: the world): every decoder
    layer is its own ``fully_shard`` unit, the root holds the rest. Returns ``policy``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


def _check(cfg: Any, world: int) -> None:
    if cfg.lora:
        raise ConfigError("--lora is single-process only; drop it with --trainer-ranks")
    if cfg.prompts < world:
        raise ConfigError(f"--prompts {cfg.prompts} leaves some of the {world} trainer ranks without a prompt: "
                          f"give at least one prompt per rank")


def train_ranked(cfg: Any, policy: Any, actors: list[Any], endpoints: list[str],
                 config: Any = None) -> Iterator[dict[str, Any]]:
    """Run ``cfg.steps`` GRPO steps on every rank of the default process group; call it on every rank with the
    same ``cfg`` and ``policy`` sharded by ``shard_policy`` (``actors``, the engines, are used on rank 0 only;
    ``endpoints`` are theirs). Yields the same log dict on every rank after each step's weights were published to
    every engine (``sync``: ``apps.ray_job.sync_summary`` of the ranks' publish). Raises on every rank what the
    publish raised, and ``RanksError`` on every rank when rank 0 could not sample."""
    import ray
    import torch
    import torch.distributed as dist

    from apps.grpo_toy import completion_logprobs, group_advantages, reward, sample, shares
    from apps.ray_job import sync_summary
    from trainer_side.multi_rank import RankedPublisher
    from trainer_side.probe import build_probe

    rank, world = dist.get_rank(), dist.get_world_size()
    _check(cfg, world)
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    vocab = int(policy.config.vocab_size)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = torch.randint(cfg.target_tokens, vocab, (cfg.prompts, cfg.prompt_len), generator=gen).tolist()
    batch = [p for p in prompts for _ in range(cfg.group)]
    spans = [(a * cfg.group, b * cfg.group) for a, b in shares(cfg.prompts, world)]  # whole groups per rank
    lo, hi = spans[rank]
    box: list[Any] = [max(int(v) for v in ray.get([a.version.remote() for a in actors], timeout=120)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    version = int(box[0])
    with RankedPublisher(endpoints, config=config) as publisher:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            parts: list[Any] | None = None
            if rank == 0:
                try:
                    rollouts = sample(actors, batch, max_tokens=cfg.max_tokens, logprobs=0, temperature=cfg.temperature)
                    sampled_from = sorted({int(r["version"]) for r in rollouts})
                    parts = [{"rollouts": rollouts[a:b], "from": sampled_from} for a, b in spans]
                except Exception as exc:  # noqa: BLE001 - Ray raises several unrelated types; every rank must hear
                    parts = [{"error": f"rank 0 could not sample step {step}: {type(exc).__name__}: {exc}"}] * world
            got: list[Any] = [None]
            dist.scatter_object_list(got, parts, src=0)
            if "error" in got[0]:
                raise RanksError(got[0]["error"])
            mine = got[0]["rollouts"]
            completions = [r["token_ids"] for r in mine]
            rewards = [reward(c, cfg.target_tokens) for c in completions]
            advantages = torch.tensor(group_advantages(rewards, cfg.group))
            t_rollout = time.perf_counter() - t0

            policy.train()
            logp, mask = completion_logprobs(policy, batch[lo:hi], completions)
            per_sequence = (logp * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            share = -(advantages * per_sequence).sum() / len(batch)  # this rank's part of the batch-mean loss
            optimizer.zero_grad()
            (share * world).backward()  # FSDP2 averages the ranks' gradients: world * mean = the batch-mean's
            optimizer.step()
            engine_lp = torch.tensor([r["logprobs"] + [0.0] * (mask.shape[1] - len(r["logprobs"])) for r in mine])
            totals = torch.tensor([sum(rewards), float(share.detach()),
                                   float(((logp.detach() - engine_lp).abs() * mask).sum()), float(mask.sum())],
                                  dtype=torch.float64)
            dist.all_reduce(totals)
            t_train = time.perf_counter() - t0 - t_rollout

            version += 1
            probe = build_probe(policy)  # a forward of the sharded policy: every rank takes part, rank 0's is sent
            sync = sync_summary(publisher.publish(policy.state_dict(), version=version, probe=probe))
            yield {
                "step": step, "reward": round(float(totals[0]) / len(batch), 4), "loss": round(float(totals[1]), 5),
                "version": version, "rollouts_from": got[0]["from"], "trainer_ranks": world, "sync": sync,
                "rollout_mean_abs_logprob_diff": round(float(totals[2]) / max(float(totals[3]), 1.0), 5),
                "seconds": {"rollout": round(t_rollout, 3), "train": round(t_train, 3),
                            "sync": round(float(sync["seconds"]), 3), "step": round(time.perf_counter() - t0, 3)},
            }


def summary_of(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean reward of the first and last quarter of the steps, and the versions whose sync did not pass."""
    from apps.ray_job import sync_passed

    k = max(1, len(lines) // 4)
    failed = [x["version"] for x in lines if not sync_passed(x["sync"])]
    out: dict[str, Any] = {"syncs": len(lines), "syncs_passed": len(lines) - len(failed), "failed_versions": failed}
    if lines:
        out["reward_first"] = round(sum(x["reward"] for x in lines[:k]) / k, 4)
        out["reward_last"] = round(sum(x["reward"] for x in lines[-k:]) / k, 4)
    return out


def torchrun_main(cfg: Any, args: Any) -> int:
    """One rank of ``torchrun --nproc-per-node N examples/grpo_toy.py --trainer-ranks N``: rank 0 starts the
    engine (a named Ray actor in a local Ray, or in ``args.ray_address``'s cluster, on rank 0's node) and prints
    the JSON lines and the summary. Returns the exit status: 0 when every step ran and every sync passed."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.trainer_ranks:
        raise RanksError(f"--trainer-ranks {args.trainer_ranks} runs under `torchrun --nproc-per-node "
                         f"{args.trainer_ranks}` (this process is one of {world})")
    dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
    try:
        return _torchrun_ranks(cfg, args)
    finally:
        dist.destroy_process_group()


def _torchrun_ranks(cfg: Any, args: Any) -> int:
    import ray
    import torch.distributed as dist

    from apps.grpo_toy import engine_options, make_policy
    from apps.ray_job import start_engine, stop_engines
    from devtools.tiny_models import save_checkpoint

    rank = dist.get_rank()
    _check(cfg, dist.get_world_size())
    actors: list[Any] = []
    box: list[Any] = [None]
    with tempfile.TemporaryDirectory(prefix="grpo-ranks-") as tmp:
        if rank == 0:
            try:
                local: dict[str, Any] = {} if args.ray_address else {"num_cpus": 2}
                ray.init(address=args.ray_address, namespace=args.namespace, log_to_driver=False, **local)
                checkpoint = save_checkpoint(make_policy(cfg), Path(tmp) / "v0")
                actor, endpoint = start_engine(checkpoint, args.actor_name, args.namespace, config=args.config,
                                               engine_options=engine_options(cfg))
                actors, box = [actor], [{"endpoint": endpoint}]
            except Exception as exc:  # noqa: BLE001 - every rank must hear why before it gives up
                box = [{"error": f"rank 0 could not start the engine: {type(exc).__name__}: {exc}"}]
        dist.broadcast_object_list(box, src=0)
        if "error" in box[0]:
            raise RanksError(box[0]["error"])
        lines: list[dict[str, Any]] = []
        served: list[int] = []
        try:
            policy = shard_policy(make_policy(cfg))  # the same seed on every rank: the weights the engine loaded
            for line in train_ranked(cfg, policy, actors, [box[0]["endpoint"]], config=args.config):
                lines.append(line)
                if rank == 0:
                    print(json.dumps(line), flush=True)
            served = [int(ray.get(a.version.remote(), timeout=120)) for a in actors]
        finally:
            if actors:
                stop_engines(actors)
    summary = summary_of(lines)
    if rank == 0:
        print(json.dumps({"summary": {"steps": len(lines), "trainer_ranks": dist.get_world_size(), **summary,
                                      "engine_versions": served, "every_sync_passed": not summary["failed_versions"]}}),
              flush=True)
    return 0 if len(lines) == cfg.steps and not summary["failed_versions"] else 1


def ray_train_loop(loop: dict[str, Any]) -> None:
    """One Ray Train worker (Ray Train made the gloo group): the GRPO loop on its shards. Rank 0 finds the engines
    by name and puts each step's line, then ``{"done": True, "error": ...}``, on ``loop["queue"]``."""
    import ray
    import torch.distributed as dist

    from apps.grpo_toy import GRPOConfig, make_policy

    cfg = GRPOConfig(**loop["grpo"])
    rank = dist.get_rank()
    queue = loop["queue"]
    actors = [ray.get_actor(name, namespace=loop["namespace"]) for name in loop["engines"]] if rank == 0 else []
    error = ""
    try:
        policy = shard_policy(make_policy(cfg))
        for line in train_ranked(cfg, policy, actors, loop["endpoints"], config=loop["config"]):
            if rank == 0:
                queue.put(line, timeout=60)
    except BridgeError as exc:  # the same error on every rank (the publisher broadcasts the outcome)
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == 0:
            queue.put({"done": True, "error": error}, timeout=60)


def run_ray_train(args: Any) -> int:
    """The Ray job's driver for ``--trainer-ranks N``: start the engines on this node (from a checkpoint of the
    initial policy), run ``ray_train_loop`` on a ``TorchTrainer`` of N CPU workers (gloo, ``STRICT_PACK``: one
    node), print each step's line as rank 0 sends it and the summary. Returns the exit status."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue

    from apps.grpo_toy import engine_options, make_policy
    from apps.ray_job import (
        EXIT_FAILED_SYNC,
        JobError,
        engine_names,
        grpo_config,
        start_engines,
        stop_engines,
    )
    from devtools.tiny_models import save_checkpoint

    cfg = grpo_config(args)
    _check(cfg, args.trainer_ranks)
    ray.init(namespace=args.namespace, log_to_driver=False)  # inside a Ray job: joins the job's cluster
    names = engine_names(args.actor_name, args.engines)
    lines: list[dict[str, Any]] = []
    done: dict[str, Any] = {}
    served: list[int] = []
    with tempfile.TemporaryDirectory(prefix="wb-ray-train-grpo-") as tmp:
        checkpoint = save_checkpoint(make_policy(cfg), Path(tmp) / "v0")
        actors, endpoints = start_engines(checkpoint, names, args.namespace, args.tp, args.dtype, args.config,
                                          args.start_timeout_s, engine_options(cfg))
        queue = Queue(actor_options={"num_cpus": 0})

        def relay() -> None:  # prints rank 0's lines while the trainer runs
            while not done:
                try:
                    item = queue.get(timeout=1.0)
                except Empty:
                    continue
                if item.get("done"):
                    done.update(item)
                else:
                    lines.append(item)
                    print(json.dumps(item), flush=True)

        printer = threading.Thread(target=relay, daemon=True)
        printer.start()
        try:
            trainer = TorchTrainer(
                ray_train_loop,
                train_loop_config={"grpo": asdict(cfg), "engines": names, "endpoints": endpoints,
                                   "namespace": args.namespace, "config": args.config, "queue": queue},
                torch_config=TorchConfig(backend="gloo", timeout_s=int(GLOO_TIMEOUT.total_seconds())),
                scaling_config=ScalingConfig(num_workers=args.trainer_ranks, use_gpu=False,
                                             resources_per_worker={"CPU": args.cpus_per_rank},
                                             placement_strategy="STRICT_PACK"),  # one node: host-local channel
                run_config=RunConfig(name="wb-grpo-ranks", storage_path=str(Path(tmp) / "ray-train")),
            )
            trainer.fit()
            printer.join(timeout=120)
            served = [int(ray.get(a.version.remote(), timeout=120)) for a in actors]
        finally:
            done.setdefault("done", True)
            stop_engines(actors)
    if printer.is_alive() or "error" not in done:
        raise JobError("rank 0 of the trainer did not report its end")
    summary = summary_of(lines)
    print(json.dumps({"summary": {"loop": "grpo", "steps": args.steps, "trainer_ranks": args.trainer_ranks,
                                  "engines": names, "engine_versions": served, **summary, "error": done["error"]}}),
          flush=True)
    ok = len(lines) == args.steps and not summary["failed_versions"] and not done["error"]
    return 0 if ok else EXIT_FAILED_SYNC

