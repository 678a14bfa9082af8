"""Typed wire messages. Headers are msgpack maps, validated where they enter; buffers travel raw.

Nothing here unpickles: a header is a msgpack map of plain scalars and lists, decoded with
size limits and turned into a frozen dataclass, or rejected with a :class:`WireError`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from bridge import PROTOCOL_VERSION, checksums
from bridge.errors import ManifestError, WireError
from bridge.transports import COLLECTIVE

if TYPE_CHECKING:
    from bridge.delta import BucketDelta, DeltaManifest
    from bridge.shards import ShardManifest

# dtype name -> element size. Names are torch's (``str(torch.bfloat16)`` without ``torch.``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"})
MAX_NAME_LEN = 1024
MAX_NDIM = 8
ALIGN = 64  # byte alignment of every tensor inside a bucket
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def _require(cond: bool, message: str, exc: type[WireError] = WireError) -> None:
    if not cond:
        raise exc(message)


def _brief(value: Any, limit: int = 80) -> str:
    """repr of a received value for an error message: bounded in length, safe on deeply nested values."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), f"{what} must be an integer, got {_brief(value)}")
    _require(lo <= value <= hi, f"{what}={value} is out of range [{lo}, {hi}]")
    return int(value)


def _float(value: Any, what: str) -> float:
    _require(isinstance(value, int | float) and not isinstance(value, bool), f"{what} must be a number, got {_brief(value)}")
    return float(value)


def _flag(value: Any, what: str) -> bool:
    _require(isinstance(value, bool), f"{what} must be true or false, not {_brief(value)}")
    return bool(value)


def _str(value: Any, what: str, max_len: int = MAX_NAME_LEN) -> str:
    _require(isinstance(value, str), f"{what} must be a string, got {type(value).__name__}")
    _require(len(value) <= max_len, f"{what} is longer than {max_len} characters")
    return str(value)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update: where its bytes lie and what they must hash to."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.bucket, self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, raw: Any) -> TensorSpec:
        _require(isinstance(raw, list | tuple) and len(raw) == 6, f"tensor entry must be a 6-item list, got {_brief(raw)}")
        name = _str(raw[0], "tensor name")
        _require(bool(_NAME_RE.fullmatch(name)) and ".." not in name, f"tensor name {name!r} is not a valid parameter path", ManifestError)
        dtype = _str(raw[1], f"dtype of {name}", 32)
        _require(dtype in DTYPE_SIZES, f"tensor {name}: unknown dtype {dtype!r}", ManifestError)
        _require(isinstance(raw[2], list | tuple) and len(raw[2]) <= MAX_NDIM, f"tensor {name}: shape must be a list of at most {MAX_NDIM} dims", ManifestError)
        shape = tuple(_int(d, f"tensor {name}: dim", 0, 1 << 40) for d in raw[2])
        spec = cls(
            name=name,
            dtype=dtype,
            shape=shape,
            bucket=_int(raw[3], f"tensor {name}: bucket", 0, 1 << 31),
            offset=_int(raw[4], f"tensor {name}: offset"),
            nbytes=_int(raw[5], f"tensor {name}: nbytes"),
        )
        expected = spec.numel * DTYPE_SIZES[dtype]
        _require(spec.nbytes == expected, f"tensor {name}: nbytes={spec.nbytes} but shape {list(shape)} of {dtype} needs {expected}", ManifestError)
        return spec


@dataclass(frozen=True)
class ProbeSpec:
    """Probe sequences and the trainer's log-probabilities of each of their tokens (after the first)."""

    sequences: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]

    def to_wire(self) -> dict[str, Any]:
        return {"sequences": [list(s) for s in self.sequences], "logprobs": [list(p) for p in self.logprobs]}

    @classmethod
    def from_wire(cls, raw: Any) -> ProbeSpec:
        _require(isinstance(raw, dict), "probe must be a map")
        seqs, lps = raw.get("sequences"), raw.get("logprobs")
        _require(isinstance(seqs, list) and isinstance(lps, list) and len(seqs) == len(lps) <= 256, "probe: sequences and logprobs must be lists of equal length (at most 256)")
        sequences = tuple(tuple(_int(t, "probe token", 0, 1 << 31) for t in s) for s in seqs)  # type: ignore[union-attr]
        logprobs = tuple(tuple(_float(x, "probe logprob") for x in p) for p in lps)  # type: ignore[union-attr]
        for s, p in zip(sequences, logprobs, strict=True):
            _require(len(p) == len(s) - 1, "probe: each sequence needs one log-probability per token after the first")
        return cls(sequences, logprobs)


ADAPTER_CONFIG_KEYS = 64  # entries a PEFT config of an adapter may hold


def _plain(value: Any, what: str, depth: int = 0) -> Any:
    """A PEFT config value: a scalar, or a list / map (string keys) of such, at most 3 levels deep."""
    if value is None or isinstance(value, bool | int | float | str):
        return _str(value, what, 4096) if isinstance(value, str) else value
    _require(depth < 3, f"{what} is nested too deeply")
    if isinstance(value, list | tuple):
        _require(len(value) <= 4096, f"{what} lists more than 4096 items")
        return [_plain(v, what, depth + 1) for v in value]
    if isinstance(value, dict):
        _require(len(value) <= ADAPTER_CONFIG_KEYS, f"{what} has more than {ADAPTER_CONFIG_KEYS} entries")
        return {_str(k, f"{what} key", 256): _plain(v, f"{what}.{k}", depth + 1) for k, v in value.items()}
    raise WireError(f"{what} must be a plain value, got {type(value).__name__}")


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter an update carries instead of base weights: its ``name`` (what generation asks for) and
    its PEFT config (``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules`` ...). The manifest's
    ``version`` is then this adapter's version (each adapter counts its own, apart from the base's), and its
    tensors are the adapter's, named as PEFT saves them
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def rank(self) -> int:
        return int(self.config.get("r", 0))

    @property
    def alpha(self) -> float:
        return float(self.config.get("lora_alpha", 0))

    @property
    def target_modules(self) -> tuple[str, ...]:
        targets = self.config.get("target_modules") or ()
        return (targets,) if isinstance(targets, str) else tuple(targets)

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "config": dict(self.config)}

    @classmethod
    def from_wire(cls, raw: Any) -> AdapterSpec:
        _require(isinstance(raw, dict), "manifest.adapter must be a map")
        name = _str(raw.get("name"), "adapter name", 128)
        _require(bool(_NAME_RE.fullmatch(name)), f"adapter name {name!r} must be letters, digits, '_', '.', '-'", ManifestError)
        config = raw.get("config")
        _require(isinstance(config, dict), f"adapter {name}: config must be a map")
        plain = _plain(config, f"adapter {name}: config")
        _int(plain.get("r"), f"adapter {name}: config.r", 1, 1 << 16)
        alpha = _float(plain.get("lora_alpha"), f"adapter {name}: config.lora_alpha")
        _require(math.isfinite(alpha), f"adapter {name}: config.lora_alpha={alpha} is not finite")
        targets = plain.get("target_modules")
        _require(isinstance(targets, str) or (isinstance(targets, list) and bool(targets) and all(isinstance(t, str) for t in targets)),
                 f"adapter {name}: config.target_modules must be a module name or a non-empty list of them")
        return cls(name=name, config=plain)


@dataclass(frozen=True)
class Manifest:
    """Everything the receiver must know before the first bucket: names, dtypes, shapes, layout."""

    version: int
    tensors: tuple[TensorSpec, ...]
    bucket_sizes: tuple[int, ...]
    publisher: str = ""
    transport: str = "zmq"
    probe: ProbeSpec | None = None
    protocol: int = PROTOCOL_VERSION
    checksum: str = "crc32"  # algorithm of every BucketHeader.checksums entry (see bridge/checksums.py)
    adapter: AdapterSpec | None = None  # a LoRA adapter's version, not the base weights (AdapterSpec)
    delta: DeltaManifest | None = None  # the tensors travel as patches against a base version (bridge/delta.py)
    # sent by many trainer ranks: which rank writes which byte ranges of each tensor (bridge/shards.py);
    # each bucket header then carries one checksum per range of the bucket, in this manifest's range order
    shards: ShardManifest | None = None
    # the publisher keeps this version as the base of its next delta (it sends deltas over this transport): a
    # receiver with ``sync.delta: auto`` keeps it too (bridge/config.py ``SyncConfig.deltas_over``)
    keep_base: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_bucket(self) -> list[list[TensorSpec]]:
        out: list[list[TensorSpec]] = [[] for _ in self.bucket_sizes]
        for spec in self.tensors:
            out[spec.bucket].append(spec)
        return out

    def to_wire(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "version": self.version,
            "publisher": self.publisher,
            "transport": self.transport,
            "bucket_sizes": list(self.bucket_sizes),
            "tensors": [t.to_wire() for t in self.tensors],
            "probe": self.probe.to_wire() if self.probe else None,
            "checksum": self.checksum,
            **({"adapter": self.adapter.to_wire()} if self.adapter is not None else {}),
            **({"delta": self.delta.to_wire()} if self.delta is not None else {}),
            **({"shards": self.shards.to_wire()} if self.shards is not None else {}),
            **({"keep_base": True} if self.keep_base else {}),
        }

    @classmethod
    def from_wire(cls, raw: Any, max_tensors: int = 1_000_000) -> Manifest:
        _require(isinstance(raw, dict), "manifest must be a map")
        protocol = raw.get("protocol")
        _require(protocol == PROTOCOL_VERSION, f"unknown protocol version {_brief(protocol)} (this receiver speaks {PROTOCOL_VERSION})")
        tensors_raw = raw.get("tensors")
        _require(isinstance(tensors_raw, list), "manifest.tensors must be a list")
        _require(len(tensors_raw) <= max_tensors, f"manifest lists {len(tensors_raw)} tensors, more than the limit {max_tensors}")
        sizes_raw = raw.get("bucket_sizes")
        _require(isinstance(sizes_raw, list) and len(sizes_raw) <= 1 << 20, "manifest.bucket_sizes must be a list")
        manifest = cls(
            version=_int(raw.get("version"), "manifest.version"),
            tensors=tuple(TensorSpec.from_wire(t) for t in tensors_raw),
            bucket_sizes=tuple(_int(s, "bucket size", 0, 1 << 40) for s in sizes_raw),
            publisher=_str(raw.get("publisher", ""), "manifest.publisher", 256),
            transport=_str(raw.get("transport", "zmq"), "manifest.transport", 32),
            probe=ProbeSpec.from_wire(raw["probe"]) if raw.get("probe") is not None else None,
            checksum=_str(raw.get("checksum", "crc32"), "manifest.checksum", 32),
            adapter=AdapterSpec.from_wire(raw["adapter"]) if raw.get("adapter") is not None else None,
            delta=_delta_from_wire(raw["delta"]) if raw.get("delta") is not None else None,
            shards=_shards(raw["shards"]) if raw.get("shards") is not None else None,
            keep_base=_flag(raw.get("keep_base", False), "manifest.keep_base"),
        )
        known = (*checksums.KNOWN, checksums.NONE)
        _require(manifest.checksum in known, f"unknown checksum algorithm {manifest.checksum!r} (known: {', '.join(known)})")
        manifest.check_layout()
        if manifest.delta is not None:
            _require(manifest.adapter is None, "manifest: an adapter update cannot travel as a delta", ManifestError)
            manifest.delta.check(manifest)
        if manifest.shards is not None:
            from bridge.shards import check_matches

            check_matches(manifest.shards, manifest.tensors)
        _require(manifest.delta is None or manifest.shards is None,
                 "manifest: an update sent by many trainer ranks cannot travel as a delta yet", ManifestError)
        return manifest

    def check_layout(self) -> None:
        """Names unique; every tensor inside its bucket; no two tensors overlap."""
        seen: set[str] = set()
        for spec in self.tensors:
            if spec.name in seen:
                raise ManifestError(f"duplicate tensor name {spec.name!r} in manifest")
            seen.add(spec.name)
            if spec.bucket >= len(self.bucket_sizes):
                raise ManifestError(f"tensor {spec.name}: bucket {spec.bucket} does not exist ({len(self.bucket_sizes)} buckets)")
            if spec.offset + spec.nbytes > self.bucket_sizes[spec.bucket]:
                raise ManifestError(
                    f"tensor {spec.name}: bytes [{spec.offset}, {spec.offset + spec.nbytes}) overflow bucket "
                    f"{spec.bucket} of {self.bucket_sizes[spec.bucket]} bytes"
                )
        for index, specs in enumerate(self.by_bucket()):
            end, last = 0, ""
            for spec in sorted(specs, key=lambda s: s.offset):
                if spec.offset < end:
                    raise ManifestError(f"tensor {spec.name} overlaps tensor {last} in bucket {index}")
                end, last = spec.offset + spec.nbytes, spec.name


def _delta_from_wire(raw: Any) -> DeltaManifest:
    from bridge.delta import DeltaManifest  # bridge.delta builds on this module

    return DeltaManifest.from_wire(raw)


def _bucket_delta(raw: Any) -> BucketDelta:
    from bridge.delta import BucketDelta

    return BucketDelta.from_wire(raw)


def _shards(raw: Any) -> ShardManifest:
    from bridge.shards import ShardManifest

    return ShardManifest.from_wire(raw)


# ---- control messages -------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    publisher: str
    protocol: int = PROTOCOL_VERSION
    type: str = field(default="hello", init=False)


@dataclass(frozen=True)
class EngineInfo:
    """The receiver's answer to Hello: what it serves and what it expects."""

    dtype: str
    version: int
    tp_size: int
    transports: tuple[str, ...]
    host: str
    protocol: int = PROTOCOL_VERSION
    type: str = field(default="info", init=False)


@dataclass(frozen=True)
class Begin:
    manifest: Manifest
    type: str = field(default="begin", init=False)


@dataclass(frozen=True)
class BucketHeader:
    """Announces bucket ``index``; its bytes follow as the next frame or, for shm, lie in ``segment``.

    ``checksums`` holds the checksum (the manifest's algorithm, zlib.crc32 unless it names another) of each tensor of the bucket, in manifest order: the manifest's
    checksums travel with their bucket so that packing bucket k+1 overlaps sending bucket k.
    ``token`` (shm only) is the publisher's random token of this send: receivers on one host that find a
    verdict on ``segment`` under the same token, bucket and checksums skip verifying it again
    (bridge/host_verdicts.py); empty, every receiver verifies.
    ``delta`` (a delta update only; bridge/delta.py ``BucketDelta``): the bucket carries patches, laid out as
    it says in ``delta.size`` bytes, and ``checksums`` are those of its payloads; None: the full tensors.
    """

    version: int
    index: int
    checksums: tuple[int, ...] = ()
    segment: str = ""
    token: str = ""
    delta: BucketDelta | None = None
    type: str = field(default="bucket", init=False)


@dataclass(frozen=True)
class RankBucket:
    """Trainer rank ``rank``'s byte ranges of bucket ``index`` of ``version`` (a sharded update over ZMQ):
    they follow as one frame, the rank's ranges of that bucket concatenated in the shard manifest's order
    (a strided range as its runs in order). Sent on the rank's own data socket, whose identity is the
    control socket's followed by ``|rank<rank>``; the checksums travel in rank 0's ``BucketHeader``."""

    version: int
    index: int
    rank: int
    type: str = field(default="ranks", init=False)


@dataclass(frozen=True)
class LinkOffer:
    """Join collective link ``link`` (``backend`` gloo or nccl) as ``rank`` of ``world``: the publisher's
    private TCPStore listens on ``host:port``. Sent before Begin when the transport is collective; bucket
    bytes then travel over the link, each right after its header."""

    link: str
    backend: str
    host: str
    port: int
    rank: int
    world: int
    type: str = field(default="link", init=False)


@dataclass(frozen=True)
class End:
    version: int
    type: str = field(default="end", init=False)


@dataclass(frozen=True)
class Abort:
    version: int
    reason: str
    type: str = field(default="abort", init=False)


@dataclass(frozen=True)
class Credit:
    """The receiver can take ``n`` more buckets (bounded in-flight, back-pressure). ``released`` names the
    buckets of this update, shared-memory ones only, that neither the receiver nor its workers will read
    again (streaming: loaded, and no incomplete layer still holds them); once every receiver released a
    bucket, the publisher may rewrite its segment for a later bucket of the same update."""

    version: int
    n: int
    released: tuple[int, ...] = ()
    type: str = field(default="credit", init=False)


@dataclass(frozen=True)
class Heartbeat:
    version: int
    phase: str
    type: str = field(default="ping", init=False)


@dataclass(frozen=True)
class Ack:
    """The end of one sync on one engine: applied (ok) or refused, with the engine's report. A refusal
    carries ``kind``, a ``bridge.report.FailureKind`` value (empty when ok)."""

    version: int
    ok: bool
    reason: str = ""
    report: dict[str, Any] = field(default_factory=dict)
    kind: str = ""
    type: str = field(default="ack", init=False)


@dataclass(frozen=True)
class StatusRequest:
    """An operator's question to a receiver (the dashboard's poll): the engine's status and its sync records
    newer than ``since`` (a ``SyncRecord.timestamp``; 0: all it keeps). Answered with a ``StatusReply`` on the
    receiver's socket thread, also while an update runs; it opens no session."""

    since: float = 0.0
    type: str = field(default="status?", init=False)


@dataclass(frozen=True)
class StatusReply:
    """The answer to ``StatusRequest``: ``status`` as ``InferenceServer.status()`` shapes it (``engine``,
    ``version``, ``tp_size``, ``dtype``, ``sessions`` ...) and ``records``, ``SyncRecord.to_dict()`` maps."""

    status: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    type: str = field(default="status", init=False)


Message = (Hello | EngineInfo | Begin | BucketHeader | RankBucket | LinkOffer | End | Abort | Credit | Heartbeat | Ack | StatusRequest
           | StatusReply)


def encode(msg: Message) -> bytes:
    if isinstance(msg, Begin):
        body: dict[str, Any] = {"type": "begin", "manifest": msg.manifest.to_wire()}
    else:
        body = asdict(msg)
        if isinstance(msg, EngineInfo):
            body["transports"] = list(msg.transports)
        if isinstance(msg, BucketHeader):
            body["checksums"] = list(msg.checksums)
            body.pop("delta")
            if msg.delta is not None:
                body["delta"] = msg.delta.to_wire()
        if isinstance(msg, Credit):
            body["released"] = list(msg.released)
    return msgpack.packb(body, use_bin_type=True)


def claimed_version(data: bytes | memoryview, max_bytes: int = 64 << 20) -> int:
    """The version a header that ``decode`` refused names, read leniently (a Begin's manifest version, else
    the message's own ``version``), so that its refusal goes to the update its sender meant; 0 when it names
    none (not msgpack, not a map, no positive integer there, or over ``max_bytes``)."""
    if len(data) > max_bytes:
        return 0
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=0, max_ext_len=0)
    except Exception:  # noqa: BLE001 - whatever msgpack makes of garbage: it names no version
        return 0
    if not isinstance(raw, dict):
        return 0
    holder = raw.get("manifest") if raw.get("type") == "begin" else raw
    version = holder.get("version") if isinstance(holder, dict) else None
    return version if type(version) is int and 0 < version < 1 << 63 else 0


def decode(data: bytes | memoryview, max_bytes: int = 64 << 20, max_tensors: int = 1_000_000) -> Message:
    """Decode and validate one header. Raises WireError naming what is wrong."""
    if len(data) > max_bytes:
        raise WireError(f"header of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_array_len=max(max_tensors * 8, 1 << 16),
            max_map_len=1 << 12,
            max_str_len=1 << 20,
            max_bin_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError) as exc:  # msgpack's ExtraData, FormatError, StackError are ValueErrors
        raise WireError(f"malformed or truncated header: {type(exc).__name__}: {exc}") from exc
    if not isinstance(raw, dict):
        raise WireError(f"header must be a map, got {type(raw).__name__}")
    kind = raw.get("type")
    try:
        if kind == "begin":
            return Begin(Manifest.from_wire(raw.get("manifest"), max_tensors=max_tensors))
        if kind == "hello":
            return Hello(publisher=_str(raw.get("publisher", ""), "publisher", 256), protocol=_int(raw.get("protocol"), "protocol"))
        if kind == "info":
            transports = raw.get("transports")
            _require(isinstance(transports, list), "info.transports must be a list")
            return EngineInfo(
                dtype=_str(raw.get("dtype"), "dtype", 32),
                version=_int(raw.get("version"), "version"),
                tp_size=_int(raw.get("tp_size"), "tp_size", 1, 1 << 16),
                transports=tuple(_str(t, "transport", 32) for t in transports),  # type: ignore[union-attr]
                host=_str(raw.get("host", ""), "host", 256),
                protocol=_int(raw.get("protocol"), "protocol"),
            )
        if kind == "bucket":
            sums = raw.get("checksums", [])
            _require(isinstance(sums, list), "bucket.checksums must be a list")
            return BucketHeader(
                version=_int(raw.get("version"), "version"),
                index=_int(raw.get("index"), "bucket index", 0, 1 << 31),
                checksums=tuple(_int(c, "checksum", 0, 0xFFFFFFFFFFFFFFFF) for c in sums),  # type: ignore[union-attr]
                segment=_str(raw.get("segment", ""), "segment", 255),
                token=_str(raw.get("token", ""), "token", 64),
                delta=_bucket_delta(raw["delta"]) if raw.get("delta") is not None else None,
            )
        if kind == "ranks":
            return RankBucket(version=_int(raw.get("version"), "version"),
                              index=_int(raw.get("index"), "bucket index", 0, 1 << 31),
                              rank=_int(raw.get("rank"), "rank", 0, 1 << 20))
        if kind == "link":
            backend = _str(raw.get("backend"), "link.backend", 16)
            _require(backend in COLLECTIVE, f"link.backend must be {' or '.join(COLLECTIVE)}, got {_brief(backend)}")
            world = _int(raw.get("world"), "link.world", 2, 1 << 16)
            return LinkOffer(
                link=_str(raw.get("link"), "link.link", 64),
                backend=backend,
                host=_str(raw.get("host"), "link.host", 255),
                port=_int(raw.get("port"), "link.port", 1, 65535),
                rank=_int(raw.get("rank"), "link.rank", 1, world - 1),
                world=world,
            )
        if kind == "end":
            return End(version=_int(raw.get("version"), "version"))
        if kind == "abort":
            return Abort(version=_int(raw.get("version"), "version"), reason=_str(raw.get("reason", ""), "reason", 1 << 16))
        if kind == "credit":
            released = raw.get("released", [])
            _require(isinstance(released, list) and len(released) <= 1 << 20, "credit.released must be a list of bucket indices")
            return Credit(version=_int(raw.get("version"), "version"), n=_int(raw.get("n"), "credit", 0, 1 << 20),
                          released=tuple(_int(i, "released bucket index", 0, 1 << 31) for i in released))  # type: ignore[union-attr]
        if kind == "ping":
            return Heartbeat(version=_int(raw.get("version"), "version"), phase=_str(raw.get("phase", ""), "phase", 64))
        if kind == "ack":
            report = raw.get("report", {})
            _require(isinstance(report, dict), "ack.report must be a map")
            return Ack(
                version=_int(raw.get("version"), "version"),
                ok=bool(raw.get("ok")),
                reason=_str(raw.get("reason", ""), "reason", 1 << 20),
                report=report,
                kind=_str(raw.get("kind", ""), "kind", 32),
            )
        if kind == "status?":
            return StatusRequest(since=_float(raw.get("since", 0.0), "status?.since"))
        if kind == "status":
            status, records = raw.get("status"), raw.get("records", [])
            _require(isinstance(status, dict), "status.status must be a map")
            _require(isinstance(records, list) and all(isinstance(r, dict) for r in records),  # type: ignore[union-attr]
                     "status.records must be a list of maps")
            return StatusReply(status=status, records=records)  # type: ignore[arg-type]
    except (TypeError, KeyError, AttributeError) as exc:
        raise WireError(f"malformed {kind} message: {exc}") from exc
    raise WireError(f"unknown message type {_brief(kind)}")
