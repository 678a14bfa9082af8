"""Fuzzing the header decoder: whatever arrives, ``decode`` returns a message or raises WireError.

Never any other exception (a ValueError or RecursionError escaping ``decode`` would kill the
receiver's socket thread instead of refusing one update). Every test is bounded: at most 300
examples, no example database kept.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge import PROTOCOL_VERSION, wire
from bridge.delta import BucketDelta, DeltaEntry, DeltaManifest, DeltaSpec
from bridge.errors import ManifestError, WireError

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGE_TYPES = tuple(wire.Message.__args__)  # type: ignore[attr-defined]


def decode_or_wire_error(data: bytes, **kw: Any) -> wire.Message | None:
    """decode(data): a message (which must survive its own re-encoding) or None on a WireError."""
    try:
        msg = wire.decode(data, **kw)
    except WireError:
        assert wire.claimed_version(data) >= 0  # what the refusal is filed under: never raises either
        return None
    assert isinstance(msg, MESSAGE_TYPES)
    again = wire.encode(msg)
    assert wire.encode(wire.decode(again)) == again  # what was accepted can be sent on unchanged
    return msg


# ---- valid samples --------------------------------------------------------------------------------

_SPECS = (
    wire.TensorSpec("model.embed_tokens.weight", "bfloat16", (4, 8), 0, 0, 64),
    wire.TensorSpec("model.layers.0.self_attn.sinks", "float32", (4,), 0, 64, 16),
    wire.TensorSpec("model.layers.0.step", "int64", (), 1, 0, 8),
    wire.TensorSpec("lm_head.weight", "float8_e4m3fn", (2, 3), 1, 64, 6),
)
_MANIFEST = wire.Manifest(version=5, tensors=_SPECS, bucket_sizes=(80, 70), publisher="t", transport="zmq",
                          probe=wire.ProbeSpec(((1, 2, 3),), ((-0.5, -1.5),)))
_ADAPTER = wire.Manifest(
    version=2, bucket_sizes=(128,), publisher="t", adapter=wire.AdapterSpec("math", {
        "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "bias": "none", "rank_pattern": {}}),
    tensors=(wire.TensorSpec("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "bfloat16", (2, 8), 0, 0, 32),
             wire.TensorSpec("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", "bfloat16", (8, 2), 0, 64, 32)))
_PATCH = DeltaSpec(name="model.layers.0.self_attn.sinks", dtype="float32", shape=(4,), encoding="sparse", codec="none",
                   base_version=4, base_checksum=9, result_checksum=10, checksum="crc32", nbytes=8, dense_nbytes=16, changed=1)
_DELTA = replace(_MANIFEST, delta=DeltaManifest(4, (1, 9, 3, 4)))
_TABLE = BucketDelta(72, (DeltaEntry(0, 64, 7), DeltaEntry(64, 8, 10, _PATCH)))
SAMPLES: list[wire.Message] = [
    wire.Hello(publisher="trainer"),
    wire.Begin(_DELTA),
    wire.BucketHeader(version=5, index=0, checksums=(7, 11), delta=_TABLE),
    wire.EngineInfo(dtype="bfloat16", version=4, tp_size=2, transports=("zmq", "shm"), host="h"),
    wire.Begin(_MANIFEST),
    wire.Begin(_ADAPTER),
    wire.BucketHeader(version=5, index=1, checksums=(1, 2), segment="wb-x"),
    wire.RankBucket(version=5, index=1, rank=3),
    wire.LinkOffer(link="ab12", backend="gloo", host="127.0.0.1", port=29500, rank=1, world=3),
    wire.End(version=5),
    wire.Abort(version=5, reason="stop"),
    wire.Credit(version=5, n=2),
    wire.Heartbeat(version=5, phase="apply"),
    wire.Ack(version=5, ok=True, reason="", report={"bytes": 10, "t": [1.5, None]}),
    wire.StatusRequest(since=12.5),
    wire.StatusReply(status={"engine": "e", "version": 5}, records=[{"version": 5, "ok": False, "kind": "nonfinite"}]),
]
ENCODED = [wire.encode(m) for m in SAMPLES]


def test_samples_are_valid() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)
    for msg, data in zip(SAMPLES, ENCODED, strict=True):
        assert wire.decode(data) == msg


# ---- raw bytes ----------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=600))
def test_decode_arbitrary_bytes(data: bytes) -> None:
    decode_or_wire_error(data)


@FUZZ
@given(st.data())
def test_decode_mutated_valid_encodings(data: st.DataObject) -> None:
    raw = bytearray(data.draw(st.sampled_from(ENCODED)))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        byte = data.draw(st.integers(0, 255))
        if op == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[pos] = byte
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
        elif op == "delete" and raw:
            del raw[pos : pos + data.draw(st.integers(1, 8))]
        elif op == "truncate":
            del raw[pos:]
        elif op == "append":
            raw.extend(data.draw(st.binary(min_size=1, max_size=9)))
    decode_or_wire_error(bytes(raw))


# ---- structured: well-formed msgpack, wrong content ---------------------------------------------

INTS = st.one_of(
    st.integers(-3, 300),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from([(1 << 62) - 1, 1 << 62, (1 << 62) + 1, 1 << 31, (1 << 31) + 1, 0xFFFFFFFF, 1 << 32, 1 << 40, -1]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "..", "../x", "begin", "float32", "zmq", "a" * 300, "1.5", "nan"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(st.text(max_size=8), children, max_size=6)),
    max_leaves=15,
)
FIELDS = ["type", "protocol", "publisher", "version", "tensors", "bucket_sizes", "manifest", "probe", "dtype", "tp_size",
          "transports", "host", "index", "checksums", "segment", "reason", "n", "phase", "ok", "report", "sequences", "logprobs", "since", "status", "records"]
TYPES = st.sampled_from(["hello", "info", "begin", "bucket", "end", "abort", "credit", "ping", "ack", "status?", "status",
                         "other"])


@FUZZ
@given(st.one_of(VALUES, st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8)))
def test_decode_random_msgpack(obj: Any) -> None:
    decode_or_wire_error(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(TYPES, st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8))
def test_decode_random_fields_of_each_type(kind: str, fields: dict[str, Any]) -> None:
    decode_or_wire_error(msgpack.packb({**fields, "type": kind}, use_bin_type=True))


def _wire_dict(msg: wire.Message) -> Any:
    return msgpack.unpackb(wire.encode(msg), raw=False)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(st.data())
def test_decode_valid_message_with_one_field_replaced(data: st.DataObject) -> None:
    """Take a valid header, replace one node anywhere in it (a field, a tensor entry, a dim, a probe
    logprob, the probe itself...) with an arbitrary value, or delete a map key."""
    tree = _wire_dict(data.draw(st.sampled_from([*SAMPLES, *[wire.Begin(_MANIFEST)] * 4, *[wire.Begin(_ADAPTER)] * 2, wire.Begin(_DELTA),
                                                   wire.BucketHeader(version=5, index=0, checksums=(7, 11), delta=_TABLE)])))  # manifests: most nodes
    path = data.draw(st.sampled_from(_paths(tree)))
    if not path:
        tree = data.draw(VALUES)
    else:
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(VALUES)
    decode_or_wire_error(msgpack.packb(tree, use_bin_type=True))


PROBE_LISTS = st.lists(st.lists(st.one_of(SCALARS, st.integers(0, 100)), max_size=4), max_size=3)


@FUZZ
@given(st.one_of(VALUES, st.fixed_dictionaries({"sequences": PROBE_LISTS, "logprobs": PROBE_LISTS}),
                 st.fixed_dictionaries({"sequences": st.just([[1, 2, 3]]), "logprobs": st.lists(st.lists(SCALARS, max_size=3), max_size=2)})))
def test_decode_random_probe(probe: Any) -> None:
    raw = _MANIFEST.to_wire()
    raw["probe"] = probe
    msg = decode_or_wire_error(msgpack.packb({"type": "begin", "manifest": raw}, use_bin_type=True))
    if msg is not None and probe is not None:
        assert isinstance(msg, wire.Begin) and msg.manifest.probe is not None
        lps = msg.manifest.probe.logprobs
        assert all(isinstance(x, float) for p in lps for x in p)
        assert all(len(p) == len(s) - 1 for s, p in zip(msg.manifest.probe.sequences, lps, strict=True))


# ---- manifests with random layouts ----------------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e", "f", "model.x", "model.layers.0.w"]
DTYPES = ["uint8", "bfloat16", "float32", "int64"]
WILD = st.one_of(
    st.integers((1 << 62) - 300, (1 << 62) + 2),  # near the limit: offset + nbytes overflows any bucket
    st.integers(-(1 << 63), -1),  # negative, which a typed encoder would never send
    st.integers((1 << 62) + 1, (1 << 64) - 1),
    st.sampled_from([-1, 1 << 31, (1 << 31) + 1, (1 << 40) - 1, 1 << 40, (1 << 40) + 1]),
)


@st.composite
def raw_tensor(draw: Any) -> list[Any]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 6), max_size=2))
    offset = draw(st.one_of(st.integers(0, 9).map(lambda k: 32 * k), st.integers(0, 300)))
    return [draw(st.sampled_from(NAMES)), dtype, shape, draw(st.integers(0, 1)), offset, math.prod(shape) * wire.DTYPE_SIZES[dtype]]


@st.composite
def raw_layout(draw: Any) -> tuple[list[list[Any]], list[int]]:
    """Small layouts (so that valid, overlapping and overflowing ones are all common), sometimes with
    one integer replaced by a wild value, an nbytes that does not match, a zero-byte tensor, a duplicate
    name, or missing buckets."""
    tensors = draw(st.lists(raw_tensor(), max_size=5, unique_by=lambda t: t[0]))
    sizes = draw(st.lists(st.one_of(st.integers(0, 700), st.just(700)), min_size=2, max_size=2))
    change = draw(st.sampled_from(["none", "none", "none", "wild", "wild", "nbytes", "zero", "dup", "one-bucket", "no-buckets"]))
    if change == "wild":
        slots = [(t, f) for t in range(len(tensors)) for f in (3, 4, 5)] + [(-1, b) for b in range(len(sizes))]
        t, f = draw(st.sampled_from(slots))
        if t < 0:
            sizes[f] = draw(WILD)
        else:
            tensors[t][f] = draw(WILD)
    elif change == "nbytes" and tensors:
        draw(st.sampled_from(tensors))[5] += draw(st.sampled_from([-2, -1, 1, 8]))
    elif change == "zero" and tensors:
        entry = draw(st.sampled_from(tensors))
        entry[2], entry[5] = [*entry[2], 0], 0
    elif change == "dup" and len(tensors) > 1:
        tensors[-1][0] = tensors[0][0]
    elif change == "one-bucket":
        sizes = sizes[:1]
    elif change == "no-buckets":
        sizes = []
    return tensors, sizes


def _expected_valid(tensors: list[list[Any]], sizes: list[int]) -> bool:
    """An independent statement of a valid layout (for manifests whose names and dtypes are fine)."""
    if not all(0 <= s <= 1 << 40 for s in sizes):
        return False
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        return False
    for _name, dtype, shape, bucket, offset, nbytes in tensors:
        if not (0 <= bucket <= 1 << 31 and 0 <= offset <= 1 << 62 and 0 <= nbytes <= 1 << 62):
            return False
        if nbytes != math.prod(shape) * wire.DTYPE_SIZES[dtype] or bucket >= len(sizes) or offset + nbytes > sizes[bucket]:
            return False
    for i, x in enumerate(tensors):
        for y in tensors[i + 1 :]:
            if x[3] == y[3] and x[5] and y[5] and x[4] < y[4] + y[5] and y[4] < x[4] + x[5]:
                return False
    return True


def _assert_layout_invariants(m: wire.Manifest) -> None:
    names = [t.name for t in m.tensors]
    assert len(set(names)) == len(names)
    for t in m.tensors:
        assert 0 <= t.bucket < len(m.bucket_sizes)
        assert 0 <= t.offset and t.offset + t.nbytes <= m.bucket_sizes[t.bucket]
        assert t.nbytes == t.numel * wire.DTYPE_SIZES[t.dtype]
    for i, x in enumerate(m.tensors):
        for y in m.tensors[i + 1 :]:
            if x.bucket == y.bucket and x.nbytes and y.nbytes:
                assert x.offset + x.nbytes <= y.offset or y.offset + y.nbytes <= x.offset, f"{x} overlaps {y}"


@FUZZ
@given(raw_layout())
def test_manifest_layouts(layout: tuple[list[list[Any]], list[int]]) -> None:
    tensors, sizes = layout
    raw = {"type": "begin", "manifest": {"protocol": PROTOCOL_VERSION, "version": 1, "tensors": tensors, "bucket_sizes": sizes}}
    data = msgpack.packb(raw, use_bin_type=True)
    try:
        msg = wire.decode(data)
    except ManifestError:
        msg = None
    except WireError as exc:  # a range error (negative, too large) is a plain WireError
        assert "out of range" in str(exc), exc
        msg = None
    expected = _expected_valid(tensors, sizes)
    if msg is not None:
        assert isinstance(msg, wire.Begin)
        assert expected, f"decode accepted an invalid layout: {tensors} in {sizes}"
        _assert_layout_invariants(msg.manifest)
        assert [t.to_wire() for t in msg.manifest.tensors] == tensors
        msg.manifest.check_layout()  # idempotent on an accepted manifest
    elif all(t[5] for t in tensors):
        # without zero-byte tensors, validity is exact: nothing valid is refused
        assert not expected, f"decode refused a valid layout: {tensors} in {sizes}"


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), max_size=3)), max_size=8),
       st.integers(1, 600))
def test_planned_layouts_always_decode(entries: list[tuple[str, list[int]]], bucket_bytes: int) -> None:
    """The positive side: whatever the trainer plans, the receiver accepts."""
    from bridge.buckets import plan_buckets

    sized = [(f"model.t{i}", math.prod(shape) * wire.DTYPE_SIZES[dt]) for i, (dt, shape) in enumerate(entries)]
    placements, sizes = plan_buckets(sized, bucket_bytes)
    specs = tuple(wire.TensorSpec(p.name, dt, tuple(shape), p.bucket, p.offset, p.nbytes)
                  for p, (dt, shape) in zip(placements, entries, strict=True))
    m = wire.Manifest(version=1, tensors=specs, bucket_sizes=tuple(sizes))
    msg = wire.decode(wire.encode(wire.Begin(m)))
    assert msg == wire.Begin(m)
    _assert_layout_invariants(m)


# ---- deep nesting -----------------------------------------------------------------------------------

_MARK = "\x00deep\x00"


def _with_deep(template: Any, depth: int, container: str) -> bytes:
    """msgpack bytes of ``template`` with the marker string replaced by ``depth`` nested containers."""
    one = {"list": b"\x91", "map": b"\x81\xa1k"}[container]
    packed = msgpack.packb(template, use_bin_type=True)
    marker = msgpack.packb(_MARK, use_bin_type=True)
    assert packed.count(marker) == 1
    return packed.replace(marker, one * depth + b"\x00")


def _manifest_with(**fields: Any) -> dict[str, Any]:
    raw = _MANIFEST.to_wire()
    raw.update(fields)
    return {"type": "begin", "manifest": raw}


DEEP_PLACES: list[tuple[str, Any]] = [
    ("top-level", _MARK),
    ("type", {"type": _MARK}),
    ("version", {"type": "end", "version": _MARK}),
    ("credit-n", {"type": "credit", "version": 1, "n": _MARK}),
    ("hello-protocol", {"type": "hello", "publisher": "p", "protocol": _MARK}),
    ("manifest", {"type": "begin", "manifest": _MARK}),
    ("manifest-protocol", _manifest_with(protocol=_MARK)),
    ("tensor-entry", _manifest_with(tensors=[_MARK])),
    ("tensor-dim", _manifest_with(tensors=[["a", "float32", [_MARK], 0, 0, 4]])),
    ("tensor-offset", _manifest_with(tensors=[["a", "float32", [1], 0, _MARK, 4], 1, 2, 3, 4, 5])),
    ("probe-logprob", _manifest_with(probe={"sequences": [[1, 2]], "logprobs": [[_MARK]]})),
    ("checksums", {"type": "bucket", "version": 1, "index": 0, "checksums": [_MARK]}),
    ("ack-report", {"type": "ack", "version": 1, "ok": False, "report": {"x": _MARK}}),
]
DEPTHS = [10, 900, 980, 1000, 1010, 1020, 1022, 1023, 1024, 10_000]


@pytest.mark.parametrize("container", ["list", "map"])
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("template", [p[1] for p in DEEP_PLACES], ids=[p[0] for p in DEEP_PLACES])
def test_deeply_nested_is_wire_error(template: Any, depth: int, container: str) -> None:
    data = _with_deep(template, depth, container)
    try:
        msg = wire.decode(data)
    except WireError as exc:
        assert len(str(exc)) < 2000  # the reason stays small enough to send back
        return
    # only an Ack's free-form report may legitimately hold a nested value
    assert isinstance(msg, wire.Ack), msg
    assert depth + 2 <= 1024  # two enclosing maps: msgpack's stack limit is 1024 containers


def test_ten_thousand_deep_list_is_wire_error() -> None:
    data = b"\x91" * 10_000 + b"\x00"
    with pytest.raises(WireError, match="malformed or truncated header: StackError"):
        wire.decode(data)


def test_delta_samples_are_consistent() -> None:
    """The delta samples the fuzzers mutate are what a receiver accepts (so the mutations test the checks)."""
    _TABLE.check(_DELTA, 0)
