"""A training loop with the bridge, as a Ray job: the job's driver is the trainer, a fleet of named
``InferenceActor`` engines spread over the cluster's nodes serves its rollouts (apps/fleet.py).

Against a cluster started with ``ray start --head``, from the repository root::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m apps.ray_job --loop grpo --steps 20

The driver starts ``--engines`` engine actors through the fleet API (``apps/fleet.py``: placed over the
cluster's nodes, fewest engines first, one relay per node with engines; named ``--actor-name``, then
``NAME-1``, ``NAME-2``, ... in namespace ``--namespace``, so ``weight-bridge serve --ray-address auto --actor
NAME`` can watch them). No node reads a checkpoint: the engines start from the policy's config and tensor
table (a ``ModelSpec``, vLLM's dummy load) and hold nothing until the driver publishes the initial policy as
version 1. Then it publishes one version per step, once per node (each node's relay hands it to its engines
over shared memory), generating between syncs:

* ``--loop grpo``: the GRPO toy loop (``apps/grpo_toy.py``, also run by ``examples/grpo_toy.py``); each
  step's rollouts are split across the engines, which sample their shares at once;
* ``--loop versions``: fresh random weights of ``--kind`` per step (any preset, also ``gpt_oss``); every
  engine generates greedily from the same prompts.

``--trainer-ranks N`` (GRPO only): the trainer is a Ray Train ``TorchTrainer`` of N CPU workers (gloo, placed
``STRICT_PACK`` on one node) with the policy FSDP2-sharded over them, each publishing its own shards; the engines
start from a checkpoint on the driver's node instead of a fleet (apps/grpo_ranks.py).

``--lora R`` (GRPO only): the engines start with LoRA enabled, the trainer trains a rank-R LoRA adapter on
the frozen base and each step publishes only the adapter (see apps/grpo_toy.py); the base stays at version 1 (the initial policy).

Each step prints one JSON line with its sync record (one entry per engine, as its relay reported it); the
last line is ``{"summary": ...}``. The exit status is 0 only if every sync passed on every engine: applied,
audited (no stale tensor, no identity violation) and its parity probe within bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.errors import BridgeError
from trainer_side.publisher import EngineReport, PublishReport

logger = logging.getLogger(__name__)

EXIT_FAILED_SYNC = 1
EXIT_ERROR = 2


class JobError(BridgeError):
    """The job cannot run as asked (an engine did not start)."""


@dataclass(frozen=True)
class JobArgs:
    loop: str
    kind: str
    steps: int
    seed: int
    actor_name: str
    namespace: str
    tp: int
    dtype: str
    config: str | None
    start_timeout_s: float
    linger_s: float = 0.0
    engines: int = 1
    lora: int = 0
    node_resource: str | None = None  # engines only on nodes holding this custom Ray resource
    trainer_ranks: int = 1  # GRPO: FSDP2 over this many Ray Train workers (apps/grpo_ranks.py)
    cpus_per_rank: float = 1.0  # Ray CPUs each trainer rank asks for


def engine_names(name: str, count: int) -> list[str]:
    """Actor names of ``count`` engines: ``name`` for the first, ``name-1``, ``name-2``, ... after it."""
    return [name if i == 0 else f"{name}-{i}" for i in range(count)]


def start_engine(checkpoint: str | Path, name: str, namespace: str, tp: int = 1, dtype: str = "bfloat16",
                 config: Any = None, timeout_s: float = 900.0, engine_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """A named ``InferenceActor`` serving ``checkpoint``, pinned to this node (the checkpoint is a local
    directory and the receiver binds loopback by default); returns the handle and its endpoint."""
    (actor,), (endpoint,) = start_engines(checkpoint, [name], namespace, tp, dtype, config, timeout_s, engine_options)
    return actor, endpoint


def start_engines(checkpoint: str | Path, names: list[str], namespace: str, tp: int = 1, dtype: str = "bfloat16",
                  config: Any = None, timeout_s: float = 900.0,
                  engine_options: dict[str, Any] | None = None) -> tuple[list[Any], list[str]]:
    """One named ``InferenceActor`` per name, all started at once on this node (``engine_options`` go to
    ``vllm.LLM``, e.g. LoRA's); returns the handles and their endpoints in the order of ``names``. If any fails
    to start, every one is killed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from inference_side import InferenceActor

    here = ray.get_runtime_context().get_node_id()
    actors = [InferenceActor.options(  # type: ignore[attr-defined]
        name=name, namespace=namespace,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(model=str(checkpoint), tensor_parallel_size=tp, dtype=dtype, config=config, name=name, **(engine_options or {}))
        for name in names]
    endpoints: list[str] = []
    deadline = time.monotonic() + timeout_s
    for name, actor in zip(names, actors, strict=True):
        try:
            endpoints.append(str(ray.get(actor.endpoint.remote(), timeout=max(deadline - time.monotonic(), 1.0))))
        except Exception as exc:  # noqa: BLE001 - Ray raises several unrelated types for a failed actor start
            for other in actors:
                ray.kill(other)
            raise JobError(f"engine actor {name!r} did not start: {type(exc).__name__}: {exc}") from exc
        logger.info("engine %s serving %s at %s", name, checkpoint, endpoints[-1])
    return actors, endpoints


def stop_engines(actors: list[Any]) -> None:
    """Shut every engine down (each its own vLLM engine), then kill its actor; one that fails to shut
    down is logged and killed, and the others are still stopped."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.shutdown.remote(), timeout=120)
        except Exception as exc:  # noqa: BLE001 - Ray raises several unrelated types for a dead actor
            logger.warning("engine actor did not shut down cleanly (%s: %s); killing it", type(exc).__name__, exc)
        finally:
            ray.kill(actor)


def engine_summary(eng: EngineReport) -> dict[str, Any]:
    """One engine's answer to a publish, compact enough for one log line."""
    rec = eng.engine
    return {
        "engine": rec.get("engine", eng.endpoint), "ok": eng.ok, "verified": eng.verified, "reason": eng.reason,
        "transport": rec.get("transport", ""), "tensors_audited": rec.get("tensors_audited", 0), "stale_tensors": list(rec.get("stale_tensors", [])),
        "identity_violations": list(rec.get("identity_violations", [])),
        "probe_mean_abs_logprob_diff": _round(rec.get("probe_mean_abs_logprob_diff"), 6),
        "probe_kl": _round(rec.get("probe_kl"), 8), "probe_flagged": bool(rec.get("probe_flagged")),
    }


def sync_summary(report: PublishReport) -> dict[str, Any]:
    """A publish's sync record: the worst of its engines at the top (ok and verified only if every engine
    is; the fewest tensors audited; every stale tensor and identity violation; the largest probe mismatch),
    each engine's own answer under ``engines``."""
    return _summary(report.version, [engine_summary(e) for e in report.engines], report.bytes,
                    report.seconds.get("total", 0.0), report.gbps, report.delta)


def fleet_sync_summary(fleet_report: Any, names: list[str]) -> dict[str, Any]:
    """A fleet publish's sync record (``apps.fleet.FleetReport``): one entry per engine of ``names`` in that
    order, as its node's relay reported it; an engine that did not answer (down, or its relay failed) is a
    failed entry naming why."""
    report = fleet_report.report
    seen: dict[str, dict[str, Any]] = {}
    for node in report.engines if report is not None else ():
        for rec in node.engine.get("relayed", []):
            name = rec.get("engine", rec["endpoint"])
            seen[name] = {
                "engine": name, "ok": bool(rec["ok"]), "verified": bool(rec["verified"]), "reason": "",
                "transport": rec.get("transport", ""), "tensors_audited": rec.get("tensors_audited", 0),
                "stale_tensors": list(rec.get("stale_tensors", [])),
                "identity_violations": list(rec.get("identity_violations", [])),
                "probe_mean_abs_logprob_diff": _round(rec.get("probe_mean_abs_logprob_diff"), 6),
                "probe_kl": _round(rec.get("probe_kl"), 8), "probe_flagged": bool(rec.get("probe_flagged"))}
    missing = {"ok": False, "verified": False, "transport": "", "tensors_audited": 0, "stale_tensors": [],
               "identity_violations": [], "probe_mean_abs_logprob_diff": None, "probe_kl": None, "probe_flagged": False}
    engines = [seen.get(n) or {"engine": n, **missing, "reason": f"not current at version {fleet_report.version}"}
               for n in names]
    total = fleet_report.seconds.get("total", 0.0)
    nbytes = report.bytes if report is not None else 0
    out = _summary(fleet_report.version, engines, nbytes, total, nbytes / total / 1e9 if total > 0 else 0.0,
                   report.delta if report is not None else {})
    out["fleet"] = {"published": fleet_report.published, "current": list(fleet_report.current),
                    "missed": list(fleet_report.missed), "nodes": len(fleet_report.nodes),
                    "copies_sent": len(report.engines) if report is not None else 0}
    return out


def _summary(version: int, engines: list[dict[str, Any]], nbytes: int, seconds: float, gbps: float,
             delta: dict[str, Any]) -> dict[str, Any]:
    diffs = [e["probe_mean_abs_logprob_diff"] for e in engines]
    kls = [e["probe_kl"] for e in engines]
    return {
        "version": version, "engine": ",".join(str(e["engine"]) for e in engines),
        "ok": bool(engines) and all(e["ok"] for e in engines),
        "verified": bool(engines) and all(e["verified"] for e in engines),
        "reason": " | ".join(f"{e['engine']}: {e['reason']}" for e in engines if e["reason"]),
        "bytes": nbytes, "seconds": round(seconds, 4), "gbps": round(gbps, 4),
        "tensors_audited": min((e["tensors_audited"] for e in engines), default=0),
        "stale_tensors": [s for e in engines for s in e["stale_tensors"]],
        "identity_violations": [v for e in engines for v in e["identity_violations"]],
        "probe_mean_abs_logprob_diff": None if None in diffs or not diffs else max(diffs),
        "probe_kl": None if None in kls or not kls else max(kls),
        "probe_flagged": any(e["probe_flagged"] for e in engines),
        # sent as patches or dense, wire and dense bytes, density (empty: deltas off), as plain JSON values
        "delta": json.loads(json.dumps(delta, default=lambda v: v.item() if hasattr(v, "item") else str(v))),
        "engines": engines,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def sync_passed(sync: dict[str, Any]) -> bool:
    """Applied and verified, with a probe result within bound."""
    return bool(sync.get("ok") and sync.get("verified") and sync.get("probe_mean_abs_logprob_diff") is not None
                and not sync.get("probe_flagged"))


def fleet_publish(fleet: Any, names: list[str]) -> Any:
    """``publish(weights, version=, probe=, adapter=)`` through ``fleet``, returning the sync record per engine
    (``fleet_sync_summary``); a version the fleet's policy did not accept is a failed record, not an exception."""
    from apps.fleet import FleetUpdateFailed

    def publish(weights: Any, version: int, probe: Any = None, adapter: Any = None) -> dict[str, Any]:
        try:
            report = fleet.publish(weights, version=version, probe=probe, adapter=adapter)
        except FleetUpdateFailed as exc:
            logger.warning("version %s: %s", version, exc)
            report = exc.report
        return fleet_sync_summary(report, names)

    return publish


def versions_loop(args: JobArgs, actors: list[Any], publish: Any) -> Iterator[dict[str, Any]]:
    """Publish fresh random weights (seed + step + 1) each step to every engine, from version 2 (version 1:
    the initial weights); greedy generation on every engine between syncs (``generated``: one list of
    completions per engine)."""
    import ray

    from devtools.tiny_models import build_model
    from trainer_side.probe import build_probe

    prompts = [[1, 2, 3, 4, 5], [100, 200, 300]]
    for step in range(args.steps):
        model = build_model(args.kind, args.seed + step + 1)
        sync = publish(model.named_parameters(), version=step + 2, probe=build_probe(model))
        outs = ray.get([actor.generate.remote(prompts, max_tokens=8) for actor in actors])
        yield {"step": step, "version": step + 2, "sync": sync, "generated": [[o["token_ids"] for o in out] for out in outs]}


def grpo_loop(args: JobArgs, actors: list[Any], publish: Any, policy: Any) -> Iterator[dict[str, Any]]:
    from apps.grpo_toy import train

    return train(grpo_config(args), policy, actors, [], config=args.config, publish=publish)


def grpo_config(args: JobArgs) -> Any:
    from apps.grpo_toy import GRPOConfig

    return GRPOConfig(kind=args.kind, steps=args.steps, seed=args.seed, lora=args.lora)


def run(args: JobArgs) -> int:
    if args.trainer_ranks > 1:
        from apps.grpo_ranks import run_ray_train

        return run_ray_train(args)
    import ray

    from apps.fleet import Fleet
    from bridge.checkpoint import ModelSpec
    from devtools.tiny_models import build_model, save_checkpoint
    from trainer_side.probe import build_probe

    options: dict[str, Any] = {}
    if args.loop == "grpo":
        from apps.grpo_toy import engine_options, make_policy

        policy = make_policy(grpo_config(args))  # the base; with --lora the adapter is added after the spec is taken
        options = engine_options(grpo_config(args))
    else:
        policy = build_model(args.kind, args.seed)
    ray.init(namespace=args.namespace, log_to_driver=False)  # inside a Ray job: joins the job's cluster
    lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="wb-ray-job-") as tmp:
        # the engines get the policy's config and tensor table only (no node reads this checkpoint's weights)
        spec = ModelSpec.from_checkpoint(save_checkpoint(policy, Path(tmp) / "v0"))
    names = engine_names(args.actor_name, args.engines)
    fleet = Fleet(spec, dtype=args.dtype, tp=args.tp, config=args.config, engine_options=options,
                  namespace=args.namespace, name=args.actor_name, start_timeout_s=args.start_timeout_s,
                  resource=args.node_resource)
    try:
        fleet.add(args.engines, names=names)
        logger.info("fleet: %s", json.dumps(fleet.status()))
        publish = fleet_publish(fleet, names)
        first = publish(policy.named_parameters(), version=1, probe=build_probe(policy))  # the initial weights
        if not sync_passed(first):
            raise JobError(f"the initial weights did not reach every engine: {first['reason']}")
        actors = [fleet.members[n].handle for n in names]
        steps = grpo_loop(args, actors, publish, policy) if args.loop == "grpo" else versions_loop(args, actors, publish)
        for line in steps:
            lines.append(line)
            print(json.dumps(line), flush=True)
        if args.linger_s > 0:
            logger.info("keeping engines %s up for %.0fs (dashboards may read them)", names, args.linger_s)
            time.sleep(args.linger_s)
        status = fleet.status()["nodes"]
        nodes = {n: len(v["engines"]) for n, v in status.items()}
        relays = sorted(v["relay"] for v in status.values() if v["relay"])
    finally:
        fleet.close()
    failed = [x["version"] for x in lines if not sync_passed(x["sync"])]
    summary: dict[str, Any] = {"loop": args.loop, "steps": args.steps, "engines": names, "nodes": nodes, "relays": relays,
                               "syncs": len(lines), "syncs_passed": len(lines) - len(failed), "failed_versions": failed,
                               "lora": args.lora}
    if args.loop == "grpo" and lines:
        k = max(1, len(lines) // 4)
        summary["reward_first"] = round(sum(x["reward"] for x in lines[:k]) / k, 4)
        summary["reward_last"] = round(sum(x["reward"] for x in lines[-k:]) / k, 4)
    print(json.dumps({"summary": summary}), flush=True)
    return 0 if lines and len(lines) == args.steps and not failed else EXIT_FAILED_SYNC


def parse(argv: list[str] | None = None) -> JobArgs:
    p = argparse.ArgumentParser(prog="apps.ray_job", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop", choices=["grpo", "versions"], default="grpo", help="what the trainer does each step (default: grpo)")
    p.add_argument("--kind", default="tiny", help="model preset: tiny, 50m, 350m, 1b (versions also: gpt_oss)")
    p.add_argument("--steps", type=int, default=20, help="versions to publish (default: 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--actor-name", default="engine-0",
                   help="name of the (first) InferenceActor; more engines are NAME-1, NAME-2, ... (default: engine-0)")
    p.add_argument("--engines", type=int, default=1, help="engine actors fed by the one trainer (default: 1)")
    p.add_argument("--node-resource", metavar="NAME",
                   help="place engines only on nodes holding this custom Ray resource (default: any alive node)")
    p.add_argument("--namespace", default="weight-bridge", help="Ray namespace (default: weight-bridge)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the engine")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype")
    p.add_argument("--config", help="weight-bridge config YAML (default: configs/default.yaml)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the engine to start")
    p.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                   help="keep the engine up this long after the last step, for dashboards (default: 0)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="GRPO: train a rank-R LoRA adapter and sync only the adapter (default: 0, every weight)")
    p.add_argument("--trainer-ranks", type=int, default=1, metavar="N",
                   help="GRPO: shard the policy with FSDP2 over N Ray Train CPU workers (gloo, one node), each "
                        "publishing its own shards to engines on the driver's node (default: 1, the driver trains)")
    p.add_argument("--cpus-per-rank", type=float, default=1.0, help="Ray CPUs per trainer rank (default: 1)")
    a = p.parse_args(argv)
    if a.trainer_ranks < 1:
        p.error("--trainer-ranks must be at least 1")
    if a.trainer_ranks > 1 and (a.loop != "grpo" or a.lora or a.node_resource):
        p.error("--trainer-ranks N > 1 runs the GRPO loop on every weight (--loop grpo, no --lora), with the engines "
                "on the driver's node (no --node-resource)")
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if a.engines < 1:
        p.error("--engines must be at least 1")
    if a.loop == "grpo" and a.kind == "gpt_oss":
        p.error("--loop grpo trains a dense policy; use --kind tiny (or 50m, ...)")
    if a.lora < 0 or (a.lora and a.loop != "grpo"):
        p.error("--lora R (R >= 1) trains an adapter in the GRPO loop only (--loop grpo)")
    return JobArgs(a.loop, a.kind, a.steps, a.seed, a.actor_name, a.namespace, a.tp, a.dtype, a.config, a.start_timeout,
                   a.linger, a.engines, a.lora, a.node_resource, a.trainer_ranks, a.cpus_per_rank)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(parse(argv))
    except BridgeError as exc:
        print(f"apps.ray_job: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
