"""One config tree of frozen dataclasses, loaded from ``configs/*.yaml``.

The only environment variable read anywhere is ``WEIGHT_BRIDGE_CONFIG`` (a path), and only here.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bridge.errors import ConfigError

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
CONFIG_ENV = "WEIGHT_BRIDGE_CONFIG"

TransportKind = Literal["zmq", "shm", "gloo", "nccl"]
SyncMode = Literal["staged", "streaming"]
NonFinitePolicy = Literal["reject", "allow"]
ChecksumChoice = Literal["auto", "xxh3", "crc32c", "crc32", "none"]


@dataclass(frozen=True)
class TransportConfig:
    kind: TransportKind = "zmq"
    bind_host: str = "127.0.0.1"  # loopback unless configured otherwise
    bucket_mb: float = 64.0
    depth: int = 2  # buckets in flight per receiver
    # CURVE (bridge/curve.py); each key a z85 string or the path of a key file from `weight-bridge keys`.
    curve_server_secret: str = ""  # receiver: its secret key (NAME.key_secret); empty: plain ZMQ
    curve_server_public: str = ""  # publisher: the receivers' public key (NAME.key); empty: plain ZMQ
    curve_client_secret: str = ""  # publisher: the key it presents; empty: a fresh one per connection
    curve_clients: tuple[str, ...] = ()  # receiver: publishers' public keys accepted (keys, files, directories)
    # receiver: bind an address other than loopback without CURVE client authentication (a trusted network)
    allow_unauthenticated: bool = False
    # receivers also listen on an ipc:// endpoint in a private 0700 directory (same-host publishers)
    listen_ipc: bool = True
    # gloo/nccl: the address receivers reach the publisher's private TCPStore at (the publisher's host)
    collective_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        clients = (self.curve_clients,) if isinstance(self.curve_clients, str) else self.curve_clients
        if not isinstance(clients, list | tuple) or not all(isinstance(c, str) and c for c in clients):
            raise ConfigError(f"transport.curve_clients must be a list of keys, key files or directories, got {clients!r}")
        object.__setattr__(self, "curve_clients", tuple(clients))
        if self.bucket_mb <= 0:
            raise ConfigError(f"transport.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.depth < 1:
            raise ConfigError(f"transport.depth must be >= 1, got {self.depth}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))


@dataclass(frozen=True)
class DeadlineConfig:
    connect_s: float = 30.0
    manifest_s: float = 30.0
    bucket_s: float = 60.0
    apply_s: float = 600.0
    verify_s: float = 120.0
    ack_s: float = 900.0
    heartbeat_s: float = 2.0


@dataclass(frozen=True)
class SyncConfig:
    mode: SyncMode = "staged"
    nonfinite: NonFinitePolicy = "reject"
    verify_checksums: bool = True
    # what a publisher sends: auto (xxh3, else crc32c, when installed, else crc32), one of them, or none (engines
    # that verify checksums refuse such updates)
    checksum: ChecksumChoice = "auto"
    # same-host shared memory: the receivers of one host verify a bucket's segment once between them (the
    # first one; the others find its verdict, bridge/host_verdicts.py); false: every receiver verifies
    verify_once_per_host: bool = True
    # keep the receive segments of the last successful update (ZMQ, gloo/NCCL) for the next one: writing
    # into pages already faulted in is several times faster; costs up to one update of /dev/shm between syncs
    keep_receive_buffers: bool = True
    max_header_bytes: int = 64 << 20
    max_tensors: int = 1_000_000
    # keep a host-memory copy of the served weights (one model's worth, in the actor process); a failure
    # after loading began then restores it instead of leaving the engine degraded
    host_copy: bool = False
    # delta updates (docs/delta.md): a publisher keeps the tensors it last published (one model of host RAM in
    # the wire dtype, also while it publishes, plus the buckets in flight) and sends each tensor as a patch against the version the engines
    # serve when that pays; a staged receiver keeps the version it last applied (one model of host RAM) to
    # rebuild full tensors from patches. false on either side: dense updates only (a receiver refuses patches
    # with kind ``base`` and its publisher resends dense). A multi-rank publisher assembles the model on rank 0's
    # host first (one more model, in /dev/shm); false keeps its ranks sending their own ranges (docs/multi_rank.md).
    # auto (the default): true for updates over zmq, gloo and nccl, false for those over shm, where a delta takes
    # about as long as dense and the bases would only cost memory (``deltas_over``)
    delta: bool | Literal["auto"] = "auto"
    # a delta patched in the receiver's base store goes to the engine bucket by bucket as each is verified (staged:
    # not after the last one; streaming: from the store, not a rebuilt copy), into an engine that can put the
    # served version back from that store should the update fail later (docs/delta.md): the load overlaps the
    # transfer; requests wait from the delta's Begin (a publisher that stalls mid-delta holds them until
    # deadlines.bucket_s ends the update). false: after the last bucket (staged), rebuilt (streaming)
    delta_early_load: bool = True
    # a publisher compresses its patches with zstd (level 1): true, false, or auto (the default): unless every
    # engine it sends to is on this host (tcp to a loopback address, ipc), where the wire moves bytes at memory
    # speed and compressing and decompressing cost more CPU than the smaller payload saves (2.3% of dense bytes
    # uncompressed against 0.7% at 1% of the elements changed; docs/delta.md, "Encodings")
    delta_compress: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        for key in ("delta", "delta_compress"):
            value = getattr(self, key)
            if not (isinstance(value, bool) or value == "auto"):
                raise ConfigError(f"sync.{key}: {value!r} is not one of [true, false, 'auto']")
        if self.host_copy and self.mode != "staged":
            # streaming updates do not refresh the copy yet: restoring it would serve stale weights
            raise ConfigError("sync.host_copy is only supported with sync.mode: staged")

    def deltas_over(self, transport: str) -> bool:
        """Whether an update over ``transport`` uses deltas: a publisher sends it as a delta where that pays, a
        receiver keeps it as the next delta's base. ``delta: true`` always, ``false`` never, ``"auto"`` on every
        transport but ``shm`` (one host: a delta takes about as long as a dense update there, docs/benchmarks.md
        "Over shared memory on one host", and the bases cost a model of host RAM on each side)."""
        return self.delta is True or (self.delta == "auto" and transport != "shm")

    def compresses_patches(self, all_on_this_host: bool) -> bool:
        """Whether a publisher compresses its patches when ``all_on_this_host`` (every engine of the update is
        reached on this host: ``bridge.curve.on_this_host``) is as given: ``delta_compress: true`` always,
        ``false`` never, ``"auto"`` unless all are on this host."""
        return self.delta_compress is True or (self.delta_compress == "auto" and not all_on_this_host)


@dataclass(frozen=True)
class RouterConfig:
    enabled: bool = True
    audit: bool = True
    identity_check: bool = True

    def worker_options(self) -> dict[str, bool]:
        """The options every TP worker's ``wb_begin`` takes."""
        return {"router": self.enabled, "audit": self.audit, "identity": self.identity_check}


@dataclass(frozen=True)
class ProbeConfig:
    enabled: bool = True
    max_mean_abs_logprob_diff: float = 0.05


# serve.engine_core_spin_s "auto" on a CPU host: longer than a small model's decode step (so generation keeps its
# latency), far shorter than a bucket's load in an update (docs/benchmarks.md, "The engine core's spin")
AUTO_ENGINE_CORE_SPIN_S = 0.005


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8321
    history: int = 2000
    # bind the actor's threads (receiver, verify) and the engine core to the cores vLLM's CPU backend left free
    # of TP workers, when it left any (inference_side/affinity.py). Off by default: on 2 cores it steadies the
    # worker but leaves the idle worker core unused while a staged update is verified (docs/benchmarks.md)
    pin_off_workers: bool = False
    # seconds a TP worker busy-waits for its next RPC after one (vLLM's shm message queue spins 1 s); null
    # leaves vLLM's value. Longer than the gap between generation steps, so generation keeps its latency,
    # short enough that a sync does not share a core with an idle, spinning worker (inference_side/idle_spin.py)
    worker_idle_spin_s: float | None = 0.05
    # seconds vLLM's engine core busy-waits for its workers' answers after each (vLLM: 1 s, so it spins through
    # every RPC of an update, a core taken from the worker's load on a small host); null leaves vLLM's value;
    # "auto": AUTO_ENGINE_CORE_SPIN_S where vLLM runs on CPU, vLLM's value on GPUs (where a spinning engine
    # core costs nothing and a shorter spin adds wake-up latency to decode steps). Applied when the engine
    # starts (bridge/vllm_plugin.py, WEIGHT_BRIDGE_ENGINE_CORE_SPIN_S)
    engine_core_spin_s: float | str | None = "auto"
    # receivers remove vLLM's own shared-memory segments (/dev/shm/psm_*) of engines that were killed when they
    # start: those no live process maps or holds open (bridge/vllm_shm.py)
    sweep_vllm_shm: bool = True
    # the bridge's updates materialize each reloaded tensor as a view of the tensor the engine serves (where
    # dtype, size and strides agree) instead of fresh memory: vLLM's copy back is then skipped and the reload
    # allocates nothing for it (inference_side/reload_hooks.py, ScratchPool.materialize_layer); false
    # materializes every tensor afresh as vLLM's own reload does
    reload_in_place: bool = True
    # threads that process the reload's layers (each layer's loaders, vLLM's processing after loading, on CPU its
    # oneDNN repacking) while the worker's RPC thread goes on with the next tensors, bound to the worker's cores
    # and those no TP worker is bound to (idle while an update runs: generation waits for it); "auto": one per
    # such core when the worker runs one torch thread on CPU (so ops do not already span several cores), else 1;
    # 1 processes each layer inline, as vLLM does (inference_side/reload_hooks.py, LayerThreads)
    reload_threads: int | str = "auto"

    def __post_init__(self) -> None:
        threads = self.reload_threads
        if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f'serve.reload_threads must be "auto" or an integer >= 1, got {threads!r}')
        for key in ("worker_idle_spin_s", "engine_core_spin_s"):
            spin = getattr(self, key)
            if key == "engine_core_spin_s" and spin == "auto":
                continue
            if spin is not None and (isinstance(spin, bool) or not isinstance(spin, int | float) or not 0 <= spin < float("inf")):
                also = ', "auto"' if key == "engine_core_spin_s" else ""
                raise ConfigError(f"serve.{key} must be null{also} or seconds >= 0, got {spin!r}")


@dataclass(frozen=True)
class BridgeConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def worker_options(self) -> dict[str, Any]:
        """The options every TP worker's ``wb_begin`` takes: the router's, ``serve.reload_in_place`` and
        ``serve.reload_threads`` (the caller adds ``spare_cores``, the cores no TP worker is bound to, where it
        knows them)."""
        return {**self.router.worker_options(), "in_place": self.serve.reload_in_place,
                "reload_threads": self.serve.reload_threads}

    def replace(self, **sections: Any) -> BridgeConfig:
        """Return a copy with sections replaced; values may be dataclasses or dicts of overrides."""
        updates = {}
        for name, value in sections.items():
            current = getattr(self, name)
            updates[name] = dataclasses.replace(current, **value) if isinstance(value, dict) else value
        return dataclasses.replace(self, **updates)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{where}.{key}")  # type: ignore[arg-type]
        else:
            kwargs[key] = _check_scalar(hint, value, f"{where}.{key}")
    return cls(**kwargs)


def _check_scalar(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):
        return value
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected float, got {value!r}")
    if hint in (int, str, bool) and not (isinstance(value, hint) and (hint is bool or not isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def config_from_dict(data: dict[str, Any] | None) -> BridgeConfig:
    return _build(BridgeConfig, data or {}, "config")


def load_config(path: str | os.PathLike[str] | None = None) -> BridgeConfig:
    """Load a config file; with no path, ``$WEIGHT_BRIDGE_CONFIG`` or ``configs/default.yaml``."""
    import yaml

    chosen = Path(path) if path else Path(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_PATH))
    try:
        text = chosen.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {chosen}: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {chosen} is not valid YAML: {exc}") from exc
    return config_from_dict(data)
