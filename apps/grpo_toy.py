"""GRPO on a toy verifiable reward, with rollouts from a vLLM engine that weight-bridge keeps current.

The task: given a prompt of random tokens, emit "target" tokens (ids below ``--target-tokens``, one
eighth of the tiny model's 512-token vocabulary by default). The reward of a completion is the fraction
of its tokens that are targets, checked exactly: a verifiable reward, no reward model.

One step of the loop:
  1. rollouts: the inference actors (vLLM engines in Ray actors) sample ``--group`` completions per
     prompt at temperature 1; with several engines the batch is split in contiguous shares, sampled at once;
  2. advantages: each completion's reward minus its group's mean, divided by the group's std (GRPO);
  3. update: policy-gradient loss on the trainer's own float32 log-probabilities of the sampled tokens
     (one on-policy update per batch, so GRPO's clipped ratio is exactly 1 and drops out), Adam step;
  4. publish: the new weights go to every engine in one ``WeightPublisher.publish`` together with the parity
     probe (``trainer_side/probe.py``); each engine applies, audits and scores the probe before it answers.

Every step prints one JSON line: reward, loss, the sync record (version, ok, verified, seconds, GB/s,
tensors audited, stale tensors, identity violations, probe mismatch) and the train/inference mismatch
on the rollouts themselves (engine's sampling logprobs vs the trainer's float32 ones). Run it on a laptop CPU:

    python examples/grpo_toy.py --steps 30

or as a Ray job on a cluster: ``python -m apps.ray_job --loop grpo`` (see apps/ray_job.py). With
``--trainer-ranks N`` the policy is FSDP2-sharded over N ranks, each publishing its own shards
(apps/grpo_ranks.py): ``torchrun --nproc-per-node 2 examples/grpo_toy.py --trainer-ranks 2``.

With ``--lora R`` the trainer trains a rank-R LoRA adapter (``apps/lora.py``, PEFT's layout, alpha 2R, on
every linear layer of the decoder blocks: q/k/v/o and gate/up/down) on top of the frozen base; the engines
start with LoRA enabled, every step publishes only the adapter (``publish(..., adapter=)``: the adapter's own
versions, the base stays at version 0) and rollouts generate with ``adapter=``. An adapter sync carries no
engine-side probe (the probe scores the base weights); instead, after each sync every engine generates
greedily from the step's prompts with the new adapter version and the trainer scores those tokens in
float32: that mean absolute log-prob difference is the sync's ``probe_mean_abs_logprob_diff``
(``probe_by: "trainer"``), flagged beyond ``probe.max_mean_abs_logprob_diff``, and every output must name
the version just published.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bridge.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPOConfig:
    kind: str = "tiny"          # policy: a dense preset of devtools.tiny_models (tiny: 2 layers, vocab 512)
    steps: int = 30
    prompts: int = 4            # distinct prompts per step
    group: int = 8              # completions sampled per prompt (the GRPO group)
    prompt_len: int = 8
    max_tokens: int = 8         # completion length
    temperature: float = 1.0
    lr: float = 3e-3
    target_tokens: int = 64     # reward counts completion tokens with id < target_tokens
    seed: int = 0
    lora: int = 0               # LoRA rank: train and sync only an adapter of this rank (0: every weight)
    lora_lr: float = 1e-2       # Adam learning rate of the adapter (with --lora)


HELP = {
    "kind": "policy preset of devtools.tiny_models", "steps": "GRPO steps (one published version each)",
    "prompts": "distinct prompts per step", "group": "completions sampled per prompt (the GRPO group)",
    "prompt_len": "tokens per prompt", "max_tokens": "tokens per completion", "temperature": "sampling temperature",
    "lr": "Adam learning rate", "target_tokens": "reward counts completion tokens with id below this",
    "seed": "seed of the policy, prompts and torch",
    "lora": "train a LoRA adapter of this rank on every linear layer of the decoder blocks and sync only the adapter; "
            "0 trains every weight",
    "lora_lr": "Adam learning rate of the LoRA adapter (with --lora)",
}

ADAPTER = "grpo"  # the adapter's name on the engines (with --lora)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM takes as max_lora_rank


def engine_options(cfg: GRPOConfig) -> dict[str, Any]:
    """``vllm.LLM`` options the engines need for ``cfg``: with ``--lora R``, LoRA enabled with room for rank R
    (vLLM's smallest allowed ``max_lora_rank`` >= R) and two adapters (the served version and the next)."""
    if not cfg.lora:
        return {}
    fits = [r for r in LORA_RANKS if r >= cfg.lora]
    if not fits:
        raise ConfigError(f"--lora {cfg.lora} is larger than vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2}


def reward(tokens: list[int], target_tokens: int) -> float:
    """Fraction of the completion's tokens that are target tokens (0.0 for an empty completion)."""
    return sum(1 for t in tokens if t < target_tokens) / len(tokens) if tokens else 0.0


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO advantages: reward minus the mean of its group, over the group's standard deviation."""
    out: list[float] = []
    for start in range(0, len(rewards), group):
        chunk = rewards[start:start + group]
        mean = sum(chunk) / len(chunk)
        std = (sum((r - mean) ** 2 for r in chunk) / len(chunk)) ** 0.5
        out += [(r - mean) / (std + 1e-4) for r in chunk]
    return out


def completion_logprobs(policy: Any, prompts: list[list[int]], completions: list[list[int]]) -> tuple[Any, Any]:
    """The policy's log-probability of every completion token, ``[batch, max_len]``, and a 0/1 mask."""
    import torch

    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = p + c
        ids[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
    logits = policy(input_ids=ids, attention_mask=attention).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    span = max(len(c) for c in completions)
    lp = torch.zeros((len(prompts), span))
    mask = torch.zeros((len(prompts), span))
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if c:  # token j of the completion sits at position len(p)+j and is predicted from position len(p)+j-1
            lp[row, :len(c)] = logp[row, len(p) - 1:len(p) - 1 + len(c)]
            mask[row, :len(c)] = 1.0
    return lp, mask


def shares(count: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` contiguous shares of ``count`` items, sizes differing by at most one
    (the first ones larger); empty shares where ``parts > count``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def sample(actors: list[Any], batch: list[list[int]], **kwargs: Any) -> list[dict[str, Any]]:
    """Rollouts of ``batch`` in order, each engine sampling its contiguous share at the same time."""
    import ray

    spans = shares(len(batch), len(actors))
    pending = [actor.generate.remote(batch[a:b], **kwargs) for actor, (a, b) in zip(actors, spans, strict=True) if b > a]
    return [r for part in ray.get(pending) for r in part]


def make_policy(cfg: GRPOConfig) -> Any:
    """A tiny random Qwen2-style policy in float32 (the trainer's precision): the base weights (``train`` adds
    the LoRA with ``--lora``, after the caller saved the base as the engines' checkpoint)."""
    from devtools.tiny_models import build_model

    return build_model(cfg.kind, cfg.seed).float()


def _probe_bound(config: Any) -> float:
    from bridge.config import BridgeConfig, config_from_dict, load_config

    resolved = config if isinstance(config, BridgeConfig) else (
        config_from_dict(config) if isinstance(config, dict) else load_config(config))
    return float(resolved.probe.max_mean_abs_logprob_diff)


def adapter_parity(actors: list[Any], policy: Any, prompts: list[list[int]], max_tokens: int,
                   version: int) -> list[dict[str, Any]]:
    """After an adapter sync: every engine generates greedily from ``prompts`` with adapter ``ADAPTER``; the
    trainer scores those tokens in float32. Per engine: the mean absolute difference of the log-probs and the
    adapter versions its outputs name (each must be ``version``)."""
    import ray
    import torch

    answers = ray.get([actor.generate.remote(prompts, max_tokens=max_tokens, logprobs=0, adapter=ADAPTER) for actor in actors])
    out = []
    was_training = policy.training
    policy.eval()
    try:
        for outs in answers:
            completions = [o["token_ids"] for o in outs]
            with torch.no_grad():
                logp, mask = completion_logprobs(policy, prompts, completions)
            engine_lp = torch.tensor([o["logprobs"] + [0.0] * (mask.shape[1] - len(o["logprobs"])) for o in outs])
            diff = float(((logp - engine_lp).abs() * mask).sum() / mask.sum().clamp(min=1.0))
            out.append({"diff": diff, "adapter_versions": sorted({o["adapter_version"] for o in outs}, key=str),
                        "ok": all(o["adapter_version"] == version for o in outs)})
    finally:
        if was_training:
            policy.train()
    return out


def with_adapter_parity(sync: dict[str, Any], parity: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """``sync`` (``apps.ray_job.sync_summary`` of an adapter publish) with the trainer's parity check of each
    engine as its probe: ``probe_mean_abs_logprob_diff`` per engine and the largest at the top, flagged beyond
    ``bound`` or when an engine's outputs did not come from the version just published."""
    engines = []
    for eng, check in zip(sync["engines"], parity, strict=True):
        flagged = check["diff"] > bound or not check["ok"]
        engines.append({**eng, "probe_mean_abs_logprob_diff": round(check["diff"], 6), "probe_flagged": flagged,
                        "adapter_versions_served": check["adapter_versions"]})
    diffs = [e["probe_mean_abs_logprob_diff"] for e in engines]
    return {**sync, "adapter": ADAPTER, "probe_by": "trainer", "engines": engines,
            "probe_mean_abs_logprob_diff": max(diffs) if diffs else None,
            "probe_flagged": any(e["probe_flagged"] for e in engines)}


def train(cfg: GRPOConfig, policy: Any, actors: list[Any], endpoints: list[str],
          config: Any = None, publish: Callable[..., dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Run ``cfg.steps`` GRPO steps with rollouts from ``actors`` (one engine each, served at ``endpoints``);
    yield one log dict per step (after its weights were published to every engine). With ``cfg.lora`` the
    policy (the base the engines serve) gets a LoRA adapter first, and each step publishes only the adapter
    (its versions ``1, 2, ...`` after the one the engines serve); the engines need ``engine_options(cfg)``.
    ``publish(weights, version=, probe=, adapter=)`` (a fleet's, see apps/ray_job.py) replaces the
    ``WeightPublisher`` to ``endpoints``; it returns the sync record (``sync_summary``'s shape)."""
    import ray
    import torch

    from apps.lora import LoRASettings, adapter_spec, adapter_tensors, add_lora
    from apps.ray_job import sync_summary
    from trainer_side import WeightPublisher
    from trainer_side.probe import build_probe

    torch.manual_seed(cfg.seed)
    spec, bound = None, 0.0
    if cfg.lora:
        if not hasattr(policy, "lora_settings"):
            add_lora(policy, LoRASettings(cfg.lora, 2.0 * cfg.lora), seed=cfg.seed)
        spec = adapter_spec(policy, ADAPTER)
        bound = _probe_bound(config)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=cfg.lora_lr if cfg.lora else cfg.lr)
    vocab = int(policy.config.vocab_size)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = torch.randint(cfg.target_tokens, vocab, (cfg.prompts, cfg.prompt_len), generator=gen).tolist()
    if cfg.lora:
        version = max(int(ray.get(actor.adapter_version.remote(ADAPTER)) or 0) for actor in actors)
    else:
        version = max(int(v) for v in ray.get([actor.version.remote() for actor in actors]))
    with contextlib.ExitStack() as stack:
        if publish is None:
            publisher = stack.enter_context(WeightPublisher(endpoints, config=config))

            def publish(weights: Any, version: int, probe: Any = None, adapter: Any = None) -> dict[str, Any]:
                return sync_summary(publisher.publish(weights, version=version, probe=probe, adapter=adapter))
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            batch = [p for p in prompts for _ in range(cfg.group)]
            # with --lora: the adapter's newest version once one was published (before that the base, which a
            # fresh adapter, B = 0, leaves unchanged)
            lora = {"adapter": ADAPTER} if cfg.lora and version > 0 else {}
            rollouts = sample(actors, batch, max_tokens=cfg.max_tokens, logprobs=0, temperature=cfg.temperature, **lora)
            completions = [r["token_ids"] for r in rollouts]
            # on-policy: the version just published (with --lora the adapter's; 0: none yet)
            sampled_from = sorted({int((r["adapter_version"] or 0) if cfg.lora else r["version"]) for r in rollouts})
            base_versions = sorted({int(r["version"]) for r in rollouts})
            rewards = [reward(c, cfg.target_tokens) for c in completions]
            advantages = torch.tensor(group_advantages(rewards, cfg.group))
            t_rollout = time.perf_counter() - t0

            policy.train()
            logp, mask = completion_logprobs(policy, batch, completions)
            per_sequence = (logp * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            loss = -(advantages * per_sequence).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            engine_lp = torch.tensor([r["logprobs"] + [0.0] * (mask.shape[1] - len(r["logprobs"])) for r in rollouts])
            rollout_mismatch = float(((logp.detach() - engine_lp).abs() * mask).sum() / mask.sum())
            t_train = time.perf_counter() - t0 - t_rollout

            version += 1
            if spec is not None:
                sync = with_adapter_parity(publish(adapter_tensors(policy), version=version, adapter=spec),
                                           adapter_parity(actors, policy, prompts, cfg.max_tokens, version), bound)
            else:
                sync = publish(policy.named_parameters(), version=version, probe=build_probe(policy))
            yield {
                "step": step, "reward": round(sum(rewards) / len(rewards), 4), "loss": round(float(loss), 5),
                "version": version, "rollouts_from": sampled_from, "base_versions": base_versions, "sync": sync,
                "rollout_mean_abs_logprob_diff": round(rollout_mismatch, 5),
                "seconds": {"rollout": round(t_rollout, 3), "train": round(t_train, 3),
                            "sync": round(float(sync["seconds"]), 3),
                            "step": round(time.perf_counter() - t0, 3)},
            }


def parse(argv: list[str] | None = None) -> tuple[GRPOConfig, argparse.Namespace]:
    defaults = GRPOConfig()
    p = argparse.ArgumentParser(prog="grpo_toy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, value in asdict(defaults).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(value), default=value, help=f"{HELP[field]} (default: {value})")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    p.add_argument("--actor-name", default="grpo-engine", help="name of the inference actor (for `weight-bridge serve --actor`)")
    p.add_argument("--namespace", default="weight-bridge", help="Ray namespace of the actor")
    p.add_argument("--config", help="weight-bridge config YAML (default: configs/default.yaml)")
    p.add_argument("--trainer-ranks", type=int, default=1, metavar="N",
                   help="shard the policy with FSDP2 over N gloo ranks, each publishing its own shards; run under "
                        "`torchrun --nproc-per-node N` (apps/grpo_ranks.py; default: 1, one process)")
    a = p.parse_args(argv)
    if not 0 <= a.lora <= LORA_RANKS[-1]:
        p.error(f"--lora must be 0 (every weight) or a rank from 1 to {LORA_RANKS[-1]}")
    if a.trainer_ranks < 1 or (a.trainer_ranks > 1 and a.lora):
        p.error("--trainer-ranks N takes N >= 1, and N > 1 trains every weight (no --lora)")
    if a.prompts < a.trainer_ranks:
        p.error(f"--prompts {a.prompts} leaves some of the {a.trainer_ranks} trainer ranks without a prompt")
    cfg = GRPOConfig(**{f: getattr(a, f) for f in asdict(defaults)})
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    import ray

    from apps.ray_job import start_engine, sync_passed
    from devtools.tiny_models import save_checkpoint

    cfg, args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.trainer_ranks > 1:
        from apps.grpo_ranks import torchrun_main
        from bridge.errors import BridgeError

        try:
            return torchrun_main(cfg, args)
        except BridgeError as exc:
            print(f"grpo_toy: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 2
    local: dict[str, Any] = {} if args.ray_address else {"num_cpus": 2}  # a local Ray: 2 CPUs
    ray.init(address=args.ray_address, namespace=args.namespace, log_to_driver=False, **local)
    policy = make_policy(cfg)
    with tempfile.TemporaryDirectory(prefix="grpo-toy-") as tmp:
        checkpoint = save_checkpoint(policy, Path(tmp) / "v0")
        actor, endpoint = start_engine(checkpoint, args.actor_name, args.namespace, config=args.config,
                                       engine_options=engine_options(cfg))
        logs = []
        try:
            for line in train(cfg, policy, [actor], [endpoint], config=args.config):
                logs.append(line)
                print(json.dumps(line), flush=True)
        finally:
            ray.get(actor.shutdown.remote())
            ray.kill(actor)
    k = max(1, len(logs) // 4)
    first = sum(x["reward"] for x in logs[:k]) / k
    last = sum(x["reward"] for x in logs[-k:]) / k
    passed = all(sync_passed(x["sync"]) for x in logs)
    print(json.dumps({"summary": {"steps": len(logs), "reward_first": round(first, 4), "reward_last": round(last, 4),
                                  "every_sync_passed": passed}}), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
