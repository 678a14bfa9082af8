"""The inference side of one engine: owns a ``vllm.LLM``, serves generation, takes weight updates.

``InferenceActor`` (see ``inference_side/__init__.py``) is this class as a Ray actor. Generation and
updates share one lock: no request ever runs while an update is being applied.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from bridge import wire
from bridge.checkpoint import read_tensor_table
from bridge.config import BridgeConfig, config_from_dict, load_config
from bridge.errors import BridgeError, ConfigError, ManifestError, VersionError
from bridge.records import SyncRecord
from bridge.transports import available as available_transports
from inference_side.receiver import ApplyResult, StagedBucket, SyncReceiver
from inference_side.streaming import StreamingGate

logger = logging.getLogger(__name__)


class EngineDegraded(BridgeError):
    """The engine refuses requests: an update failed after loading began; a complete version is needed."""


def resolve_config(config: BridgeConfig | dict[str, Any] | str | None) -> BridgeConfig:
    if isinstance(config, BridgeConfig):
        return config
    if isinstance(config, dict):
        return config_from_dict(config)
    return load_config(config)


class InferenceServer(StreamingGate):
    def __init__(self, model: str, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 config: BridgeConfig | dict[str, Any] | str | None = None, name: str | None = None,
                 **llm_kwargs: Any) -> None:
        from inference_side.engine import start_llm

        self.config = resolve_config(config)
        self.model_path = str(Path(model))
        self.tp_size = tensor_parallel_size
        self.dtype = dtype
        self.name = name or f"engine-{socket.gethostname()}"
        self.table = read_tensor_table(self.model_path)
        self.llm = start_llm(self.model_path, tensor_parallel_size, dtype, llm_kwargs)
        self.setup = self.llm.collective_rpc("wb_setup")
        if self.config.serve.worker_idle_spin_s is not None:
            self.llm.collective_rpc("wb_idle_spin", args=(self.config.serve.worker_idle_spin_s,))
        if self.config.serve.pin_off_workers:  # status()["cores"] shows where the threads ended up
            from inference_side.affinity import pin_off_workers

            pin_off_workers([r["pid"] for r in self.setup], [set(r["cpus"]) for r in self.setup])
        self._lock = threading.RLock()
        self._version = 0
        self._generated = 0  # sequences generated (rollouts served) since start
        self._degraded: str | None = None
        self._records: deque[SyncRecord] = deque(maxlen=self.config.serve.history)
        self._host_copy = self._load_host_copy() if self.config.sync.host_copy else None
        self.receiver = SyncReceiver(self, self.config, on_event=self._on_event)
        self._endpoint = self.receiver.start()
        logger.info("%s serving %s at %s", self.name, self.model_path, self._endpoint)

    # ---- public API (Ray methods) ----------------------------------------------------------------
    def endpoint(self, kind: str = "tcp") -> str:
        """Where publishers connect: ``tcp`` (any host allowed by transport.bind_host) or ``ipc`` (this host)."""
        if kind == "ipc":
            if not self.receiver.ipc_endpoint:
                raise ConfigError("this engine does not listen on ipc:// (transport.listen_ipc is false)")
            return self.receiver.ipc_endpoint
        if kind != "tcp":
            raise ConfigError(f"unknown endpoint kind {kind!r}: tcp or ipc")
        return self._endpoint

    def version(self) -> int:
        return self._version

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "endpoint": self._endpoint,
            "ipc_endpoint": self.receiver.ipc_endpoint,
            "version": self._version,
            "degraded": self._degraded,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "sinks": self.setup[0].get("sinks", []) if self.setup else [],
            "sessions": self.receiver.summary(),
            "host_copy": self._host_copy is not None,
            "sequences_generated": self._generated,
            "cores": {"workers": [r["cpus"] for r in self.setup], "worker_pids": [r["pid"] for r in self.setup],
                      "receiver": self.receiver.cores()},
        }

    def records(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self._records]

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, logprobs: int | None = None,
                 temperature: float = 0.0, seed: int | None = None) -> list[dict[str, Any]]:
        """Token-id prompts in, token ids (and each sampled token's logprob) out. Greedy by default."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=logprobs,
                                seed=seed, detokenize=False)
        with self._lock:
            if self._degraded:
                raise EngineDegraded(f"engine {self.name} is degraded: {self._degraded}")
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            self._generated += len(outs)
        result = []
        for out in outs:
            comp = out.outputs[0]
            lps = None
            if logprobs is not None and comp.logprobs is not None:
                lps = [step[tok].logprob for tok, step in zip(comp.token_ids, comp.logprobs, strict=True)]
            result.append({"token_ids": list(comp.token_ids), "logprobs": lps})
        return result

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of each token after the first, under the served weights."""
        with self._lock:
            return self._score(sequences)

    def read_params(self, paths: list[str]) -> list[dict[str, list[float]]]:
        """Each TP rank's live values of the given parameters (vLLM names)."""
        with self._lock:
            return self.llm.collective_rpc("wb_read", args=(paths,))

    def backend_sinks(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.llm.collective_rpc("wb_backend_sinks")

    def bypass_tensors(self) -> list[list[str]]:
        return self.llm.collective_rpc("wb_bypass")

    def shutdown(self) -> None:
        self.receiver.stop()

    def test_only_arm_load_failure(self, name: str) -> list[str]:
        """Test-only fault injection: every TP worker raises once, inside the next update, when it
        reaches tensor ``name`` (after loading began). Used by tests/test_faults.py."""
        return self.llm.collective_rpc("wb_test_only_arm_failure", args=(name,))

    # ---- EngineGate ---------------------------------------------------------------------------
    @staticmethod
    def _transports() -> tuple[str, ...]:
        """Every data plane this host can receive on (NCCL only where a GPU is visible)."""
        import torch

        return tuple(t for t in available_transports() if t != "nccl" or torch.cuda.is_available())

    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype=self.dtype, version=self._version, tp_size=self.tp_size,
                               transports=self._transports(), host=socket.gethostname())

    def validate(self, manifest: wire.Manifest) -> str | None:
        if manifest.version < self._version:
            raise VersionError(f"version {manifest.version} is older than the served version {self._version}")
        if manifest.version == self._version and not self._degraded:
            return f"version {manifest.version} already served"
        for spec in manifest.tensors:
            entry = self.table.get(spec.name)
            if entry is None:
                raise ManifestError(f"unknown tensor name {spec.name!r}: the engine's checkpoint has no such tensor")
            if spec.shape != entry.shape:
                raise ManifestError(f"tensor {spec.name}: shape {list(spec.shape)} does not match the engine's {list(entry.shape)}")
            want = self.dtype if entry.dtype in wire.FLOAT_DTYPES else entry.dtype
            if spec.dtype != want:
                raise ManifestError(f"tensor {spec.name}: dtype {spec.dtype} does not match the engine's {want}")
        return None

    def apply(self, manifest: wire.Manifest, buckets: list[StagedBucket], timings: dict[str, float]) -> ApplyResult:
        payload = [
            {"segment": b.segment.name, "size": b.segment.size,
             "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in b.specs]}
            for b in buckets
        ]
        options = {"router": self.config.router.enabled, "audit": self.config.router.audit,
                   "identity": self.config.router.identity_check}
        t0 = time.perf_counter()
        with self._lock:
            if manifest.version < self._version or (manifest.version == self._version and not self._degraded):
                # another update (a second publisher) got there first while this one was staged
                return self._record(manifest, False, f"VersionError: version {manifest.version} is not newer than the "
                                    f"served version {self._version} (applied meanwhile by another update)", {}, timings)
            reports = self.llm.collective_rpc("wb_apply", args=(payload, options))
            apply_s = time.perf_counter() - t0
            errors = [f"rank {r.get('rank')}: {r['error']}" for r in reports if not r.get("ok")]
            if errors:
                reason = " | ".join(errors)
                restored = self._restore_host_copy(manifest, options) if self._host_copy is not None else None
                if restored:
                    reason += f" (rolled back from the host copy: the engine serves version {self._version})"
                else:
                    self._degraded = f"update to v{manifest.version} failed after loading began: {reason}"
                    if restored is not None:
                        reason += " (restoring the host copy failed too: the engine is degraded)"
                self.llm.reset_prefix_cache()
                return self._record(manifest, False, reason, {"apply": apply_s}, timings, reports)
            if self._host_copy is not None:
                self._keep_host_copy(buckets)
            self.llm.reset_prefix_cache()
            self._version = manifest.version
            self._degraded = None
            probe = self._probe(manifest.probe) if manifest.probe and self.config.probe.enabled else {}
        return self._record(manifest, True, "", {"apply": apply_s}, timings, reports, probe)

    # ---- host copy (sync.host_copy) ---------------------------------------------------------------
    def _load_host_copy(self) -> dict[str, Any]:
        """The served weights in checkpoint names, as the engine would receive them (floats in its dtype)."""
        import torch
        from safetensors.torch import load_file

        copy: dict[str, Any] = {}
        for path in sorted(Path(self.model_path).glob("*.safetensors")):
            for name, tensor in load_file(str(path)).items():
                copy[name] = tensor.to(getattr(torch, self.dtype)) if tensor.is_floating_point() else tensor
        logger.info("%s keeps a host copy of %d tensors", self.name, len(copy))
        return copy

    def _keep_host_copy(self, buckets: list[StagedBucket]) -> None:
        import torch

        assert self._host_copy is not None
        for bucket in buckets:
            for spec in bucket.specs:
                raw = torch.frombuffer(bucket.segment.buffer, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset) \
                    if spec.nbytes else torch.empty(0, dtype=torch.uint8)
                self._host_copy[spec.name] = raw.clone().view(getattr(torch, spec.dtype)).view(spec.shape)

    def _restore_host_copy(self, manifest: wire.Manifest, options: dict[str, Any]) -> bool:
        """Reload, on every rank, the host copy of each tensor the failed update may have overwritten."""
        import torch

        from bridge.shm import Segment

        assert self._host_copy is not None
        tensors, offset = [], 0
        for spec in manifest.tensors:
            value = self._host_copy[spec.name].contiguous()
            nbytes = value.numel() * value.element_size()
            tensors.append((spec.name, value, offset, nbytes))
            offset += nbytes
        segment = Segment.create("restore", offset)
        try:
            out = torch.frombuffer(segment.mm, dtype=torch.uint8, count=offset) if offset else torch.empty(0, dtype=torch.uint8)
            for _, value, off, nbytes in tensors:
                if nbytes:
                    out[off:off + nbytes].copy_(value.view(-1).view(torch.uint8))
            del out
            payload = [{"segment": segment.name, "size": offset,
                        "tensors": [[n, str(v.dtype).removeprefix("torch."), list(v.shape), off, nb] for n, v, off, nb in tensors]}]
            reports = self.llm.collective_rpc("wb_apply", args=(payload, options))
        finally:
            segment.close()
        failed = [f"rank {r.get('rank')}: {r.get('error')}" for r in reports if not r.get("ok")]
        if failed:
            logger.error("%s: restoring the host copy failed: %s", self.name, " | ".join(failed))
            return False
        logger.warning("%s: update to v%s failed; restored v%s from the host copy", self.name, manifest.version, self._version)
        return True

    # ---- internals ----------------------------------------------------------------------------
    def _score(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        scored = []
        for seq, out in zip(sequences, outs, strict=True):
            steps = out.prompt_logprobs or []
            scored.append([steps[i][tok].logprob for i, tok in enumerate(seq) if i > 0 and steps[i] is not None])
        return scored

    def _probe(self, probe: wire.ProbeSpec) -> dict[str, Any]:
        engine = self._score([list(s) for s in probe.sequences])
        diffs, kls = [], []
        for mine, theirs in zip(engine, probe.logprobs, strict=True):
            for a, b in zip(mine, theirs, strict=False):
                diffs.append(abs(a - b))
                r = b - a  # log(p_trainer / p_engine) on tokens of the probe
                kls.append(math.exp(r) - 1 - r)
        mad = sum(diffs) / len(diffs) if diffs else 0.0
        kl = sum(kls) / len(kls) if kls else 0.0
        return {"probe_mean_abs_logprob_diff": mad, "probe_kl": kl,
                "probe_flagged": mad > self.config.probe.max_mean_abs_logprob_diff}

    def _record(self, manifest: wire.Manifest, ok: bool, reason: str, extra: dict[str, float],
                timings: dict[str, float], reports: list[dict[str, Any]] | None = None,
                probe: dict[str, Any] | None = None) -> ApplyResult:
        reports = reports or []
        seconds = dict(timings)
        seconds.update(extra)
        for phase in ("load", "finalize", "verify"):
            vals = [r.get("seconds", {}).get(phase, 0.0) for r in reports if r.get("ok")]
            if vals:
                seconds[phase] = max(vals)
        # The engine's wall time of the whole sync, manifest in -> applied: what GB/s and the charts use.
        seconds.setdefault("total", seconds.get("stream_total", seconds.get("transfer", 0.0) + seconds.get("apply", 0.0)))
        stale = tuple(s for r in reports for s in r.get("stale", []))
        if not ok and reason and "stale" in reason:
            stale = stale or tuple(p.strip() for p in reason.split(";"))
        record = SyncRecord(
            version=manifest.version, engine=self.name, ok=ok, reason=reason, bytes=manifest.total_bytes,
            tensors=len(manifest.tensors), seconds=seconds,
            tensors_audited=sum(int(r.get("tensors", 0)) for r in reports if r.get("ok")),
            stale_tensors=stale,
            identity_violations=tuple(v for r in reports for v in r.get("identity_violations", [])),
            routed_sinks=max((len(r.get("routed_sinks", [])) for r in reports), default=0),
            routed_bypass=max((len(r.get("routed_bypass", [])) for r in reports), default=0),
            transport=manifest.transport,
            **(probe or {}),
        )
        self._records.append(record)
        return ApplyResult(ok, reason, record.to_dict() | {"ranks": reports})

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind in ("refused", "timeout", "aborted", "conflict"):
            self._records.append(SyncRecord(version=int(data.get("version", 0)), engine=self.name, ok=False,
                                            reason=f"{kind}: {data.get('reason', '')}"))
