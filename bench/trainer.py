"""The benchmark's trainer process: builds one synthetic model once, then obeys JSON commands on stdin.

Commands (one JSON object per line; one JSON answer per line on stdout, prefixed ``BENCH ``):
``{"op": "publish", "endpoints": [...], "transport": "shm", "version": 7, "config": {...}}`` -> the
publish report (its ``seconds.total`` runs from tensors in this process to every engine's verified ack;
with ``"precast": "bfloat16"`` the tensors are already in the wire dtype, so only the transport works);
``{"op": "save", "dir": D}`` -> seconds of ``save_pretrained`` (baseline A's first half);
``{"op": "vllm", "url": U, "base_port": P, "config": {...}, "version": 7}`` -> one ``send_weights()`` of vLLM's
``WeightBridgeTrainerEngine`` (made once per url, port and config with ``HTTPVLLMWeightSyncClient``) to the
``vllm serve`` at U: its publish report (``last_report``), ``send_weights`` (seconds of the whole call: the
publish, vLLM's HTTP control calls, pause/resume and the prefix-cache reset) and ``http`` (seconds per route);
``{"op": "vllm_close"}`` -> shuts those engines down;
``{"op": "lora_init", "rank": 8, "targets": [...]}`` -> a copy of the model with a LoRA adapter (``apps/lora.py``,
B made non-zero as after training): ``adapter_bytes``, ``full_bytes``;
``{"op": "lora", "how": "adapter" | "full" | "merged", "endpoints": [...], "transport": T, "version": 7, "config": {...}}``
-> one sync of that copy: ``adapter`` publishes the adapter alone (``adapter=``, its own versions), ``full`` the
base weights, ``merged`` merges the adapter into the base weights (``W + scaling * B A``) and publishes them all;
its ``seconds.total`` then includes the merge (``seconds.merge``). Each adapter sync first nudges the adapter
(untimed), so every version differs; these publishers are kept per endpoints until ``{"op": "lora_close"}``;
``{"op": "step", "density": 0.01, "seed": 3}`` -> ``bench.delta_link.rl_step_`` on the model's tensors in place (the
next RL-like version: that share of each tensor's elements scaled by 1 + 0.01 N(0, 1)): its seconds;
``{"op": "quit"}``. Publish answers carry the publish's delta telemetry (``delta``: mode, wire and dense bytes, density).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from apps.job import report_line
from bridge.config import config_from_dict
from bridge.errors import BridgeError
from devtools.tiny_models import build_model, save_checkpoint
from trainer_side.publisher import WeightPublisher


def _answer(obj: dict[str, Any]) -> None:
    print("BENCH " + json.dumps(obj), flush=True)


class _TimedPosts:
    """Seconds of every ``requests.post`` made in this process while entered, summed per route (the last part of
    the URL); the trainer engine and vLLM's HTTP client both post through ``requests.post``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __enter__(self) -> _TimedPosts:
        import requests

        self._post = post = requests.post

        def timed(url: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return post(url, *args, **kwargs)
            finally:
                route = url.split("?")[0].rsplit("/", 1)[-1]
                self.seconds[route] = self.seconds.get(route, 0.0) + time.perf_counter() - t0

        requests.post = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import requests

        requests.post = self._post


def _vllm_sync(model: Any, engines: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from trainer_side.vllm_backend import WeightBridgeInitInfo

    key = json.dumps([cmd["url"], cmd["base_port"], cmd.get("config", {})], sort_keys=True)
    try:
        engine: Any = engines.get(key)
        if engine is None:
            for old in engines.values():
                old.shutdown()
            engines.clear()
            engine = engines[key] = WeightTransferTrainerFactory.trainer_init(  # a WeightBridgeTrainerEngine
                WeightBridgeInitInfo(rank=0, base_port=int(cmd["base_port"]), config=cmd.get("config", {})),
                client=HTTPVLLMWeightSyncClient(cmd["url"]), source=ModuleSource(model))
        with _TimedPosts() as posts:
            t0 = time.perf_counter()
            engine.send_weights(version=int(cmd["version"]))
            whole = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - answered to bench.run, which stops the run with it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report = engine.last_report
    assert report is not None
    return {**report_line(report), "engine_seconds": [e.seconds for e in report.engines], "send_weights": whole,
            "http": posts.seconds}


class _LoRA:
    """The adapter rows' side of the trainer: a LoRA copy of the model and its publishers (one per endpoints,
    transport and config, kept between syncs so that alternating syncs do not reconnect)."""

    ADAPTER = "bench"

    def __init__(self, model: Any, rank: int, targets: tuple[str, ...]) -> None:
        import copy

        import torch

        from apps.lora import LoRASettings, add_lora

        self.model = copy.deepcopy(model)
        add_lora(self.model, LoRASettings(rank, 2.0 * rank, targets), seed=11)
        self.gen = torch.Generator().manual_seed(12)
        self.base = [(n, p.detach()) for n, p in model.named_parameters()]
        self.publishers: dict[str, WeightPublisher] = {}
        self.nudge()

    def nudge(self) -> None:
        """A small random step on every adapter weight, as a training step makes (B leaves zero)."""
        import torch

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if ".lora_" in name:
                    param.add_(0.01 * torch.randn(param.shape, generator=self.gen).to(param.dtype))

    def sync(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from apps.lora import adapter_spec, adapter_tensors, merged_tensors

        key = json.dumps([cmd["endpoints"], cmd["transport"], cmd.get("config", {})], sort_keys=True)
        pub = self.publishers.get(key)
        if pub is None:
            pub = self.publishers[key] = WeightPublisher(cmd["endpoints"], config=config_from_dict(cmd.get("config", {})),
                                                         transport=cmd["transport"])
        how, version = cmd["how"], int(cmd["version"])
        try:
            if how == "adapter":
                self.nudge()
                report = pub.publish(adapter_tensors(self.model), version=version, adapter=adapter_spec(self.model, self.ADAPTER))
                return {**report_line(report), "engine_seconds": [e.seconds for e in report.engines]}
            if how == "full":
                report = pub.publish(self.base, version=version)
                return {**report_line(report), "engine_seconds": [e.seconds for e in report.engines]}
            if how == "merged":
                t0 = time.perf_counter()
                merged = merged_tensors(self.model)
                merge = time.perf_counter() - t0
                report = pub.publish(merged, version=version)
                line = report_line(report)
                line["seconds"] = {**line["seconds"], "merge": merge, "publish": line["seconds"].get("total", 0.0),
                                   "total": merge + line["seconds"].get("total", 0.0)}
                return {**line, "engine_seconds": [e.seconds for e in report.engines]}
        except BridgeError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": False, "error": f"unknown sync {how!r}: adapter, full or merged"}

    def close(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        self.publishers.clear()


def serve(kind: str, seed: int) -> int:
    from apps.lora import adapter_tensors, nbytes

    model = build_model(kind, seed)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    lora: _LoRA | None = None
    publishers: dict[str, WeightPublisher] = {}
    precast: dict[str, list[tuple[str, Any]]] = {}
    vllm_engines: dict[str, Any] = {}
    _answer({"ready": True, "bytes": sum(t.numel() * t.element_size() for _, t in named)})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "save":
            t0 = time.perf_counter()
            save_checkpoint(model, cmd["dir"])
            _answer({"seconds": time.perf_counter() - t0})
        elif op == "vllm":
            _answer(_vllm_sync(model, vllm_engines, cmd))
        elif op == "vllm_close":
            for engine in vllm_engines.values():
                engine.shutdown()
            vllm_engines.clear()
            _answer({"ok": True})
        elif op == "lora_init":
            if lora is not None:
                lora.close()
            lora = _LoRA(model, int(cmd["rank"]), tuple(cmd["targets"]))
            _answer({"ok": True, "adapter_bytes": nbytes(adapter_tensors(lora.model)), "full_bytes": nbytes(named)})
        elif op == "lora":
            _answer(lora.sync(cmd) if lora is not None else {"ok": False, "error": "lora_init first"})
        elif op == "lora_close":
            if lora is not None:
                lora.close()
            lora = None
            _answer({"ok": True})
        elif op == "step":
            from bench.delta_link import rl_step_

            t0 = time.perf_counter()
            rl_step_([t for _, t in named], float(cmd["density"]), int(cmd["seed"]))
            _answer({"ok": True, "seconds": time.perf_counter() - t0})
        elif op == "publish":
            key = json.dumps([cmd["endpoints"], cmd["transport"], cmd.get("config", {})], sort_keys=True)
            pub = publishers.get(key)
            if pub is None:
                for old in publishers.values():
                    old.close()
                publishers.clear()
                pub = publishers[key] = WeightPublisher(cmd["endpoints"], config=config_from_dict(cmd.get("config", {})),
                                                        transport=cmd["transport"])
            weights = named
            if cmd.get("precast"):
                import torch

                dtype = cmd["precast"]
                weights = precast.setdefault(dtype, [(n, t.to(getattr(torch, dtype))) for n, t in named])
            try:
                report = pub.publish(weights, version=int(cmd["version"]))
                _answer({**report_line(report), "engine_seconds": [e.seconds for e in report.engines],
                         "base_bytes": pub.base_bytes, "delta": json.loads(json.dumps(report.delta, default=lambda v: v.item() if hasattr(v, "item") else str(v)))})
            except BridgeError as exc:
                _answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        else:
            _answer({"ok": False, "error": f"unknown op {op!r}"})
    for pub in publishers.values():
        pub.close()
    if lora is not None:
        lora.close()
    for engine in vllm_engines.values():
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.trainer", description=__doc__)
    p.add_argument("--kind", required=True)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    return serve(a.kind, a.seed)


if __name__ == "__main__":
    sys.exit(main())
