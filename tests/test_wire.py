"""Typed wire messages: every message type round-trips; every malformed header is a WireError
(or ManifestError) whose message names the problem."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from bridge import PROTOCOL_VERSION, wire
from bridge.errors import ManifestError, WireError
from tests.helpers import manifest, spec


def _begin_bytes(manifest_wire: dict[str, Any]) -> bytes:
    return msgpack.packb({"type": "begin", "manifest": manifest_wire}, use_bin_type=True)


def _with_tensors(entries: list[list[Any]], sizes: list[int], **overrides: Any) -> bytes:
    raw = manifest().to_wire()
    raw["tensors"] = entries
    raw["bucket_sizes"] = sizes
    raw.update(overrides)
    return _begin_bytes(raw)


# ---- round trips -----------------------------------------------------------------------------

PROBE = wire.ProbeSpec(sequences=((1, 2, 3), (7, 8)), logprobs=((-0.5, -1.25), (-2.0,)))

ROUND_TRIP = [
    wire.Hello(publisher="trainer-0"),
    wire.Hello(publisher="", protocol=PROTOCOL_VERSION),
    wire.EngineInfo(dtype="bfloat16", version=7, tp_size=2, transports=("zmq", "shm"), host="node-1"),
    wire.Begin(manifest()),
    wire.Begin(manifest(publisher="p", transport="shm", probe=PROBE)),
    wire.Begin(manifest([], [])),
    wire.Begin(manifest([spec("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "bfloat16", (2, 8))], [32],
                        adapter=wire.AdapterSpec("math", {"r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"],
                                                          "task_type": "CAUSAL_LM", "rank_pattern": {}, "bias": None}))),
    wire.BucketHeader(version=3, index=1, checksums=(0, 0xFFFFFFFF, 12345)),
    wire.BucketHeader(version=3, index=0, checksums=(), segment="wb-recv-abc"),
    wire.BucketHeader(version=3, index=0, checksums=(7,), segment="wb-pub-1-abc", token="0123456789abcdef"),
    wire.RankBucket(version=3, index=2, rank=5),
    wire.LinkOffer(link="0123abcd", backend="gloo", host="10.0.0.2", port=29500, rank=2, world=3),
    wire.End(version=3),
    wire.Abort(version=3, reason="trainer crashed"),
    wire.Credit(version=3, n=2),
    wire.Credit(version=3, n=1, released=(0, 4, 5)),
    wire.Heartbeat(version=3, phase="apply"),
    wire.Ack(version=3, ok=True, reason="", report={"bytes": 123, "timings": {"apply": 0.5}, "names": ["a"]}),
    wire.Ack(version=3, ok=False, reason="ChecksumError: tensor x"),
    wire.StatusRequest(),
    wire.StatusRequest(since=1700000000.25),
    wire.StatusReply(status={"engine": "vllm@h:1", "version": 2, "degraded": None, "sessions": []},
                     records=[{"version": 2, "ok": True, "seconds": {"total": 0.5}, "stale_tensors": []}]),
    wire.StatusReply(status={"error": "boom"}),
]


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=lambda m: type(m).__name__)
def test_encode_decode_round_trip(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert isinstance(data, bytes)
    back = wire.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert back.type == msg.type
    # memoryview input (what the receiver passes from a zmq frame) decodes the same
    assert wire.decode(memoryview(data)) == msg


def test_every_message_type_is_covered_by_round_trip() -> None:
    covered = {type(m) for m in ROUND_TRIP}
    assert covered == set(wire.Message.__args__)  # type: ignore[attr-defined]


def test_manifest_helpers() -> None:
    m = manifest()
    assert m.total_bytes == 8 * 4 * 2 + 16 * 4 + 4 * 4 + 8
    assert [[s.name for s in b] for b in m.by_bucket()] == [
        ["model.embed_tokens.weight", "model.layers.0.mlp.weight"],
        ["model.norm.weight", "model.step"],
    ]
    assert spec(shape=(2, 3, 4)).numel == 24
    assert spec(shape=()).numel == 1
    assert wire.Manifest.from_wire(m.to_wire()) == m
    kept = dataclasses.replace(m, keep_base=True)  # absent from the wire unless set
    assert "keep_base" not in m.to_wire() and wire.Manifest.from_wire(kept.to_wire()) == kept


def test_tensor_spec_from_wire_round_trip() -> None:
    sinks = spec("model.layers.3.self_attn.sinks", "bfloat16", (2, 3), 4, 128)
    assert wire.TensorSpec.from_wire(sinks.to_wire()) == sinks
    assert wire.TensorSpec.from_wire(tuple(sinks.to_wire())) == sinks


# ---- rejections --------------------------------------------------------------------------------

T = ["model.norm.weight", "float32", [4], 0, 0, 16]  # a valid raw tensor entry


def _t(**kw: Any) -> list[Any]:
    entry = list(T)
    for key, value in kw.items():
        entry[["name", "dtype", "shape", "bucket", "offset", "nbytes"].index(key)] = value
    return entry


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


REJECT: list[tuple[str, bytes, type[WireError], str]] = [
    ("non-map-list", _pack([1, 2, 3]), WireError, "header must be a map"),
    ("non-map-int", _pack(5), WireError, "header must be a map"),
    ("non-map-str", _pack("begin"), WireError, "header must be a map"),
    ("unknown-type", _pack({"type": "gimme"}), WireError, "unknown message type 'gimme'"),
    ("missing-type", _pack({"version": 1}), WireError, "unknown message type None"),
    ("empty-bytes", b"", WireError, "malformed or truncated"),
    ("truncated", wire.encode(wire.End(version=3))[:-1], WireError, "malformed or truncated"),
    ("trailing-data", wire.encode(wire.End(version=3)) + b"\x00", WireError, "malformed or truncated"),
    ("reserved-byte", b"\xc1", WireError, "malformed or truncated"),
    ("binary-field", _pack({"type": "end", "version": 1, "x": b"raw"}), WireError, "malformed or truncated"),
    ("int-map-key", _pack({"type": "end", 1: 2}), WireError, "malformed or truncated"),
    ("ext-type", _pack({"type": "end", "x": msgpack.ExtType(5, b"ab")}), WireError, "malformed or truncated"),
    ("protocol-1", _with_tensors([T], [16], protocol=1), WireError, "unknown protocol version 1"),
    ("protocol-4", _with_tensors([T], [16], protocol=4), WireError, "unknown protocol version 4"),
    ("protocol-missing", _with_tensors([T], [16], protocol=None), WireError, "unknown protocol version None"),
    ("adapter-not-map", _with_tensors([T], [16], adapter=[1]), WireError, "manifest.adapter must be a map"),
    ("adapter-bad-name", _with_tensors([T], [16], adapter={"name": "../x", "config": {"r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}}),
     ManifestError, "adapter name '../x'"),
    ("adapter-no-rank", _with_tensors([T], [16], adapter={"name": "a", "config": {"lora_alpha": 1, "target_modules": ["q_proj"]}}),
     WireError, "adapter a: config.r must be an integer"),
    ("adapter-nan-alpha", _with_tensors([T], [16], adapter={"name": "a", "config": {"r": 1, "lora_alpha": float("nan"), "target_modules": "q_proj"}}),
     WireError, "config.lora_alpha=nan is not finite"),
    ("adapter-no-targets", _with_tensors([T], [16], adapter={"name": "a", "config": {"r": 1, "lora_alpha": 1, "target_modules": []}}),
     WireError, "config.target_modules must be"),
    ("manifest-not-map", _pack({"type": "begin", "manifest": [1]}), WireError, "manifest must be a map"),
    ("tensors-not-list", _pack({"type": "begin", "manifest": {**manifest().to_wire(), "tensors": {"a": 1}}}), WireError, "manifest.tensors must be a list"),
    ("duplicate-name", _with_tensors([T, _t(offset=64)], [128]), ManifestError, "duplicate tensor name 'model.norm.weight'"),
    ("overflow", _with_tensors([_t(offset=8)], [16]), ManifestError, "overflow bucket 0 of 16 bytes"),
    ("overflow-huge-offset", _with_tensors([_t(offset=(1 << 62) - 8)], [16]), ManifestError, "overflow bucket"),
    ("missing-bucket", _with_tensors([_t(bucket=1)], [16]), ManifestError, "bucket 1 does not exist"),
    ("overlap", _with_tensors([T, _t(name="b", offset=8)], [64]), ManifestError, "overlaps"),
    ("overlap-unsorted", _with_tensors([_t(name="b", offset=32, shape=[8], nbytes=32), _t(name="a", offset=0, shape=[9], nbytes=36)], [64]),
     ManifestError, "tensor b overlaps tensor a in bucket 0"),
    ("nbytes-mismatch", _with_tensors([_t(nbytes=12)], [16]), ManifestError, "nbytes=12 but shape [4] of float32 needs 16"),
    ("nbytes-dtype-mismatch", _with_tensors([_t(dtype="bfloat16")], [16]), ManifestError, "needs 8"),
    ("unknown-dtype", _with_tensors([_t(dtype="float128")], [16]), ManifestError, "unknown dtype 'float128'"),
    ("dtype-not-str", _with_tensors([_t(dtype=4)], [16]), WireError, "must be a string"),
    ("name-dotdot-slash", _with_tensors([_t(name="../x")], [16]), ManifestError, "'../x' is not a valid parameter path"),
    ("name-empty", _with_tensors([_t(name="")], [16]), ManifestError, "'' is not a valid parameter path"),
    ("name-dotdot", _with_tensors([_t(name="model..x")], [16]), ManifestError, "not a valid parameter path"),
    ("name-slash", _with_tensors([_t(name="model/x")], [16]), ManifestError, "not a valid parameter path"),
    ("name-leading-dot", _with_tensors([_t(name=".x")], [16]), ManifestError, "not a valid parameter path"),
    ("name-space", _with_tensors([_t(name="a b")], [16]), ManifestError, "not a valid parameter path"),
    ("name-newline", _with_tensors([_t(name="a\n")], [16]), ManifestError, "not a valid parameter path"),
    ("name-too-long", _with_tensors([_t(name="a" * 1025)], [16]), WireError, "longer than 1024 characters"),
    ("name-not-str", _with_tensors([_t(name=5)], [16]), WireError, "tensor name must be a string"),
    ("entry-short", _with_tensors([T[:5]], [16]), WireError, "tensor entry must be a 6-item list"),
    ("entry-map", _with_tensors([{"name": "a"}], [16]), WireError, "tensor entry must be a 6-item list"),
    ("too-many-dims", _with_tensors([_t(shape=[1] * 9, nbytes=4)], [16]), ManifestError, "at most 8 dims"),
    ("shape-not-list", _with_tensors([_t(shape=4)], [16]), ManifestError, "at most 8 dims"),
    ("negative-dim", _with_tensors([_t(shape=[-4])], [16]), WireError, "dim=-4 is out of range"),
    ("negative-offset", _with_tensors([_t(offset=-64)], [16]), WireError, "offset=-64 is out of range"),
    ("offset-too-big", _with_tensors([_t(offset=1 << 63)], [16]), WireError, "is out of range"),
    ("float-offset", _with_tensors([_t(offset=0.0)], [16]), WireError, "offset must be an integer"),
    ("bool-bucket", _with_tensors([_t(bucket=False)], [16]), WireError, "bucket must be an integer"),
    ("negative-bucket-size", _with_tensors([T], [-16]), WireError, "bucket size=-16 is out of range"),
    ("bucket-sizes-not-list", _with_tensors([T], [16], bucket_sizes=16), WireError, "bucket_sizes must be a list"),
    ("version-missing", _with_tensors([T], [16], version=None), WireError, "manifest.version must be an integer"),
    ("keep-base-int", _with_tensors([T], [16], keep_base=1), WireError, "manifest.keep_base must be true or false"),
    ("probe-lengths", _with_tensors([T], [16], probe={"sequences": [[1, 2]], "logprobs": []}), WireError, "equal length"),
    ("probe-per-token", _with_tensors([T], [16], probe={"sequences": [[1, 2]], "logprobs": [[-1.0, -2.0]]}), WireError,
     "one log-probability per token"),
    ("hello-no-protocol", _pack({"type": "hello", "publisher": "p"}), WireError, "protocol must be an integer"),
    ("info-transports", _pack({"type": "info", "dtype": "x", "version": 1, "tp_size": 1, "transports": "zmq", "protocol": 1}),
     WireError, "info.transports must be a list"),
    ("info-tp0", _pack({"type": "info", "dtype": "x", "version": 1, "tp_size": 0, "transports": [], "protocol": 1}),
     WireError, "tp_size=0 is out of range"),
    ("bucket-checksum-range", _pack({"type": "bucket", "version": 1, "index": 0, "checksums": [-1]}), WireError,
     "checksum=-1 is out of range"),
    ("credit-released-map", _pack({"type": "credit", "version": 1, "n": 1, "released": {}}), WireError,
     "credit.released must be a list of bucket indices"),
    ("credit-released-negative", _pack({"type": "credit", "version": 1, "n": 1, "released": [-1]}), WireError,
     "released bucket index=-1 is out of range"),
    ("bucket-token-long", _pack({"type": "bucket", "version": 1, "index": 0, "token": "t" * 65}), WireError,
     "token is longer than 64 characters"),
    ("bucket-token-int", _pack({"type": "bucket", "version": 1, "index": 0, "token": 5}), WireError,
     "token must be a string, got int"),
    ("bucket-checksums-map", _pack({"type": "bucket", "version": 1, "index": 0, "checksums": {}}), WireError,
     "bucket.checksums must be a list"),
    ("credit-too-many", _pack({"type": "credit", "version": 1, "n": (1 << 20) + 1}), WireError, "credit=1048577 is out of range"),
    ("end-no-version", _pack({"type": "end"}), WireError, "version must be an integer, got None"),
    ("link-backend", _pack({"type": "link", "link": "a", "backend": "mpi", "host": "h", "port": 1, "rank": 1, "world": 2}),
     WireError, "link.backend must be gloo or nccl, got 'mpi'"),
    ("link-rank-0", _pack({"type": "link", "link": "a", "backend": "gloo", "host": "h", "port": 1, "rank": 0, "world": 2}),
     WireError, "link.rank=0 is out of range [1, 1]"),
    ("link-port", _pack({"type": "link", "link": "a", "backend": "gloo", "host": "h", "port": 70000, "rank": 1, "world": 2}),
     WireError, "link.port=70000 is out of range"),
    ("abort-reason-int", _pack({"type": "abort", "version": 1, "reason": 3}), WireError, "reason must be a string"),
    ("ack-report-list", _pack({"type": "ack", "version": 1, "ok": True, "report": []}), WireError, "ack.report must be a map"),
    ("ping-phase-long", _pack({"type": "ping", "version": 1, "phase": "x" * 65}), WireError, "phase is longer than 64"),
]


@pytest.mark.parametrize(("data", "exc", "phrase"), [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_decode_rejects(data: bytes, exc: type[WireError], phrase: str) -> None:
    with pytest.raises(exc) as info:
        wire.decode(data)
    assert type(info.value) is exc, f"expected exactly {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    assert phrase in str(info.value)


def test_decode_rejects_header_over_max_bytes() -> None:
    data = wire.encode(wire.Begin(manifest()))
    assert wire.decode(data, max_bytes=len(data)) == wire.Begin(manifest())
    with pytest.raises(WireError, match=rf"header of {len(data)} bytes exceeds the limit of {len(data) - 1}"):
        wire.decode(data, max_bytes=len(data) - 1)


def test_decode_rejects_too_many_tensors() -> None:
    data = wire.encode(wire.Begin(manifest()))  # 4 tensors
    assert len(wire.decode(data, max_tensors=4).manifest.tensors) == 4  # type: ignore[union-attr]
    with pytest.raises(WireError, match="manifest lists 4 tensors, more than the limit 3"):
        wire.decode(data, max_tensors=3)


def test_ack_ok_is_coerced_to_bool() -> None:
    msg = wire.decode(_pack({"type": "ack", "version": 1, "ok": 1}))
    assert isinstance(msg, wire.Ack) and msg.ok is True


# ---- check_layout on a constructed manifest -----------------------------------------------------

@pytest.mark.parametrize(
    ("tensors", "sizes", "phrase"),
    [
        ([spec("a", offset=0), spec("b", offset=8)], [64], "tensor b overlaps tensor a in bucket 0"),
        ([spec("a", offset=8), spec("b", offset=0)], [64], "tensor a overlaps tensor b in bucket 0"),
        ([spec("a", offset=0), spec("a", offset=64)], [128], "duplicate tensor name 'a'"),
        ([spec("a", offset=56)], [64], "bytes [56, 72) overflow bucket 0 of 64 bytes"),
        ([spec("a", bucket=2)], [64, 64], "bucket 2 does not exist (2 buckets)"),
    ],
    ids=["overlap", "overlap-reverse", "duplicate", "overflow", "no-bucket"],
)
def test_check_layout_rejects(tensors: list[wire.TensorSpec], sizes: list[int], phrase: str) -> None:
    m = wire.Manifest(version=1, tensors=tuple(tensors), bucket_sizes=tuple(sizes))
    with pytest.raises(ManifestError) as info:
        m.check_layout()
    assert phrase in str(info.value)


@pytest.mark.parametrize(
    ("tensors", "sizes"),
    [
        ([spec("a", offset=0), spec("b", offset=16)], [32]),  # touching, not overlapping
        ([spec("a", offset=0), spec("b", bucket=1, offset=0)], [16, 16]),  # same offset, other bucket
        ([spec("a", offset=16), spec("b", offset=0)], [32]),  # out of offset order
        ([spec("z", shape=(0,), offset=0), spec("a", offset=0)], [16]),  # zero-size tensor
        ([], []),
    ],
    ids=["touching", "other-bucket", "unsorted", "zero-size", "empty"],
)
def test_check_layout_accepts(tensors: list[wire.TensorSpec], sizes: list[int]) -> None:
    m = wire.Manifest(version=1, tensors=tuple(tensors), bucket_sizes=tuple(sizes))
    m.check_layout()
    assert wire.decode(wire.encode(wire.Begin(m))) == wire.Begin(m)


def test_error_messages_are_bounded_for_huge_values() -> None:
    """A huge field must not turn into a huge error message (the reason travels back in an Ack)."""
    data = _pack({"type": "end", "version": list(range(100_000))})
    with pytest.raises(WireError) as info:
        wire.decode(data)
    assert "version must be an integer" in str(info.value)
    assert len(str(info.value)) < 1000


def test_probe_logprob_must_be_a_number() -> None:
    data = _with_tensors([T], [16], probe={"sequences": [[1, 2]], "logprobs": [["abc"]]})
    with pytest.raises(WireError, match="probe logprob must be a number"):
        wire.decode(data)


# ---- the version a refused header meant -----------------------------------------------------------

@pytest.mark.parametrize(("data", "version"), [
    (b"\xc1 not msgpack", 0),
    (_pack([1, 2, 3]), 0),
    (_pack({"type": "no-such-type", "version": 4}), 4),  # a message of another protocol that names one
    (_with_tensors([_t(dtype=4)], [16], version=9), 9),  # a Begin whose manifest is malformed names its version
    (_pack({"type": "begin", "manifest": {"version": 7, "tensors": "x"}}), 7),
    (_pack({"type": "begin", "version": 7}), 0),  # a Begin's version is its manifest's
    (_pack({"type": "begin", "manifest": {"version": True}}), 0),
    (_pack({"type": "begin", "manifest": {"version": -3}}), 0),
    (_pack({"type": "begin", "manifest": {"version": 1 << 63}}), 0),
    (_pack({"type": "bucket", "version": 5, "index": -1}), 5),
    (_pack({"type": "end"}), 0),
], ids=["garbage", "list", "other-type", "begin-bad-dtype", "begin-bad-tensors", "begin-no-manifest", "bool", "negative",
        "huge", "bucket", "none"])
def test_claimed_version_names_the_update_a_refused_header_meant(data: bytes, version: int) -> None:
    """The receiver refuses a header ``decode`` rejects under this version: a publisher's broken Begin ends its
    own update (vLLM's update_weights waiting for it), a stray peer's garbage (0) ends none."""
    with pytest.raises(WireError):
        wire.decode(data)
    assert wire.claimed_version(data) == version
