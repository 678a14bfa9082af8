"""Helpers the tests share, written once: paths, child processes, free ports, small named weights, manifests,
the engine oracle. A plain module (``from tests.helpers import ...``); fixtures and pytest hooks stay in
tests/conftest.py, the engine stand-in is tests/fakes.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bridge import wire

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 300, 400]]
ARTIFACTS = ROOT / "artifacts"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_in(ports: range) -> int | None:
    """The first port of ``ports`` free on 127.0.0.1 (at the time of asking); None when all are taken."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return None


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, what: str | Callable[[], str] = "the condition") -> Any:
    """Poll ``pred`` until it returns something true (returned) or ``timeout`` seconds passed (AssertionError
    naming ``what``, or what it returns then)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")


# ---- weights and manifests ------------------------------------------------------------------------------

def weights(seed: int, count: int = 6, shape: tuple[int, ...] | Callable[[int], tuple[int, ...]] = (64, 96),
            name: str = "model.layers.{i}.mlp.down_proj.weight", dtype: str = "bfloat16",
            poison: str = "") -> list[tuple[str, Any]]:
    """``count`` named tensors drawn from ``torch.randn`` seeded with ``seed`` (one generator, in order),
    cast to ``dtype``. ``name`` is formatted with the index ``i``; ``shape`` may depend on it. ``poison``
    names a tensor that is all NaN instead."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        dims = shape(i) if callable(shape) else shape
        out.append((name.format(i=i), torch.randn(*dims, generator=gen).to(getattr(torch, dtype))))
    if poison:
        out = [(n, torch.full_like(t, float("nan")) if n == poison else t) for n, t in out]
    return out


def spec(name: str = "model.norm.weight", dtype: str = "float32", shape: tuple[int, ...] = (4,), bucket: int = 0,
         offset: int = 0, nbytes: int | None = None) -> wire.TensorSpec:
    """A tensor's place in a bucket; ``nbytes`` defaults to what its shape and dtype take."""
    if nbytes is None:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * wire.DTYPE_SIZES[dtype]
    return wire.TensorSpec(name, dtype, shape, bucket, offset, nbytes)


def manifest(tensors: Iterable[wire.TensorSpec] | None = None, sizes: Iterable[int] | None = None,
             **fields: Any) -> wire.Manifest:
    """A manifest of ``tensors`` in buckets of ``sizes`` (``version`` 3 unless given); without tensors, four
    of mixed dtypes in two buckets."""
    if tensors is None:
        tensors = [
            spec("model.embed_tokens.weight", "bfloat16", (8, 4), 0, 0),
            spec("model.layers.0.mlp.weight", "float32", (4, 4), 0, 64),
            spec("model.norm.weight", "float32", (4,), 1, 0),
            spec("model.step", "int64", (), 1, 64),
        ]
        sizes = [128, 72]
    return wire.Manifest(version=fields.pop("version", 3), tensors=tuple(tensors), bucket_sizes=tuple(sizes or ()),
                         **fields)


def plan_manifest(plan: Any, version: int = 1, **fields: Any) -> wire.Manifest:
    """The manifest a publisher sends for a packing plan (trainer_side.packing.make_plan)."""
    from trainer_side.packing import plan_specs

    return wire.Manifest(version=version, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes, **fields)


# ---- engines: the oracle, trainers in their own process ------------------------------------------------

_ORACLE_CACHE: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
_COLD_LOADERS: dict[int, Any] = {}


def cold_loader(tp: int) -> Any:
    """The session's ``devtools.coldload.ColdLoader`` at TP size ``tp``: one process for every cold load at that
    size (each still a fresh engine built from the checkpoint), stopped when the session ends."""
    if tp not in _COLD_LOADERS:
        import atexit

        from devtools.coldload import ColdLoader

        if not _COLD_LOADERS:
            atexit.register(lambda: [loader.close() for loader in _COLD_LOADERS.values()])
        _COLD_LOADERS[tp] = ColdLoader(tp, env=child_env())
    return _COLD_LOADERS[tp]


def oracle(models: list[Path], tp: int, dtype: str, prompts: list[list[int]] = PROMPTS) -> list[list[dict[str, Any]]]:
    """Greedy outputs of plain vLLM engines cold-loaded from each checkpoint (the session's cold-load process).
    Kept per checkpoint content (and TP size, dtype, prompts): a checkpoint whose files equal one cold-loaded
    before, wherever it was saved, is answered from that load."""
    keys = [(_checkpoint_key(Path(m)), tp, dtype, json.dumps(prompts)) for m in models]
    todo = {key: str(m) for m, key in zip(models, keys, strict=True) if key not in _ORACLE_CACHE}
    if todo:
        outs = cold_loader(tp).outputs(list(todo.values()), dtype, prompts)
        for key, model in todo.items():
            _ORACLE_CACHE[key] = outs[model]
    return [_ORACLE_CACHE[key] for key in keys]


def _checkpoint_key(model: Path) -> str:
    """A checkpoint directory's content: every file's relative name and bytes (xxh3-128)."""
    import xxhash

    digest = xxhash.xxh3_128()
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(model)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()



_LORA_ORACLE_CACHE: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = {}


def _content_digest(directory: Path, names: Iterable[str] | None = None) -> str:
    """A digest of the files of ``directory`` (only ``names`` when given, those present): equal for two directories
    holding the same weights and configs, wherever they lie."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and (names is None or path.name in names or (path.suffix == ".safetensors" and
                                                                       "*.safetensors" in names)):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def lora_oracle(base: Path, loras: list[Path], tp: int, dtype: str, prompts: list[list[int]] = PROMPTS,
                max_lora_rank: int = 8, max_loras: int = 2) -> dict[str, list[dict[str, Any]]]:
    """What ``devtools.coldload.cold_lora_outputs`` gives (keys ``"base"`` and each of ``loras`` as a string), computed once
    per test session for each content: the base's weights and config and each adapter directory's files, TP size,
    dtype, prompts and LoRA limits (the engine reads no tokenizer: files beside the weights do not count). Modules
    checking the same adapters on the same base against the oracle, in different directories, share one cold load."""
    base_key = _content_digest(Path(base), ("config.json", "generation_config.json", "*.safetensors"))
    lora_keys = [_content_digest(Path(d)) for d in loras]
    key = (base_key, tuple(lora_keys), tp, dtype, json.dumps(prompts), max_lora_rank, max_loras)
    if key not in _LORA_ORACLE_CACHE:
        cold = cold_loader(tp).lora_outputs(str(base), [str(d) for d in loras], dtype, prompts,
                                            max_lora_rank=max_lora_rank, max_loras=max_loras)
        _LORA_ORACLE_CACHE[key] = {"base": cold["base"], **{k: cold[str(d)] for k, d in zip(lora_keys, loras, strict=True)}}
    cached = _LORA_ORACLE_CACHE[key]
    return {"base": cached["base"], **{str(d): cached[k] for k, d in zip(lora_keys, loras, strict=True)}}

def run_trainer(endpoint: str, kind: str, seeds: list[int], first_version: int, save_dir: Path | None = None,
                transport: str | None = None, config: str | None = None, timeout: float = 600) -> list[dict[str, Any]]:
    """Publish from a separate trainer process; return its JSON report lines."""
    cmd = [sys.executable, "-m", "apps.job", "--endpoint", endpoint, "--kind", kind, "--version", str(first_version)]
    for s in seeds:
        cmd += ["--seed", str(s)]
    if save_dir:
        cmd += ["--save-dir", str(save_dir)]
    if transport:
        cmd += ["--transport", transport]
    if config:
        cmd += ["--config", config]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=timeout, cwd=ROOT)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, f"trainer printed nothing (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return lines


def rl_step(model: Any, seed: int, density: float = 0.01) -> None:
    """Change ``density`` (RL steps: 1-3%, docs/delta.md) of every parameter's elements by 1 to 8 units in the last
    place (bf16 bit patterns), a step of an optimizer's size; elements near zero or near the largest exponent are
    left alone."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            bits = param.data.view(torch.int16).view(-1)
            picked = torch.randperm(bits.numel(), generator=gen)[: max(1, int(density * bits.numel()))]
            magnitude = bits[picked] & 0x7FFF
            picked = picked[(magnitude > 0x0100) & (magnitude < 0x7E00)]
            step = torch.randint(1, 9, (picked.numel(),), generator=gen, dtype=torch.int16)
            sign = torch.where(torch.rand(picked.numel(), generator=gen) < 0.5, -1, 1).to(torch.int16)
            bits[picked] += step * sign


def assert_same_outputs(got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["token_ids"] == w["token_ids"], f"prompt {i}: tokens {g['token_ids']} != cold-loaded {w['token_ids']}"
        for j, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"], strict=True)):
            assert abs(a - b) <= tol, f"prompt {i} token {j}: logprob {a} != cold-loaded {b}"


def generate(actor: Any, prompts: list[list[int]] = PROMPTS) -> list[dict[str, Any]]:
    import ray

    return ray.get(actor.generate.remote(prompts, max_tokens=8, logprobs=1))


@contextmanager
def vllm_serve(ckpt: Path, port: int, log_path: Path, tp: int = 1, startup_s: float = 420,
               extra: tuple[str, ...] = ()) -> Iterator[str]:
    """``vllm serve`` with the ``weight_bridge`` backend on ``ckpt`` (devtools/serve.py), this checkout first on
    its ``PYTHONPATH``; yields its base URL once ``/health`` answers, stops it afterwards."""
    from devtools.serve import served

    with served(ckpt, port, log_path, tp=tp, extra=extra, env=child_env(), start_timeout_s=startup_s) as url:
        yield url


def start_local_ray() -> None:
    """The test session's own Ray: always a new local cluster (``address="local"``), never another cluster found
    on the machine (``ray.init()`` alone joins the newest one it finds, e.g. a namespace cluster's head)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})


@contextmanager
def ray_connected(address: str, env: dict[str, str] | None = None, namespace: str | None = None,
                  runtime_env: dict[str, Any] | None = None) -> Iterator[Any]:
    """This process as a driver of the Ray cluster at ``address`` (with ``env``, e.g. a cluster's auth token, in
    ``os.environ`` meanwhile; ``runtime_env``: the job's, for every actor it starts), then back: the test session's own local Ray (``ray_session``) is shut down first
    (a process drives one cluster at a time) and started again on the way out when it was running."""
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    was = ray.is_initialized()
    ray.shutdown()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    reset_auth_token_state()  # Ray caches the auth mode and token of the first cluster this process joined
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, runtime_env=runtime_env)
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reset_auth_token_state()
        if was:
            start_local_ray()


# ---- the session's namespace cluster (the ``netns_cluster`` fixture, tests/conftest.py) ----------------------

# The one multi-node Ray cluster of the session (devtools/netns_cluster.py), for tests/test_fleet.py,
# tests/test_ray_job.py and tests/test_netns_cluster.py: what each needs, merged. Two worker nodes (hosts of their
# own) and the head; 2 CPUs per node (a Ray job's driver and engines); the jobs API on the head's address; the
# worker nodes hold ``wb_worker`` (the job places its engines by it); Ray's out-of-memory killer off (the machine
# is shared with other engines: it must not pick this cluster's workers because of theirs).
NETNS = {"prefix": "wbt", "subnet": "10.201.9.0/24", "port": 45190}
NETNS_WORKER_RESOURCE = "wb_worker"


def netns_leftovers(prefix: str) -> str:
    """The links and network namespaces whose names hold ``prefix`` (one line each)."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return "\n".join(line for line in (links + netns).splitlines() if prefix in line)
