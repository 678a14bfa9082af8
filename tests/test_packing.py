"""Trainer-side packing (plan, pack, specs) and the receiver's per-bucket verification, end to end on
small CPU tensors and plain byte buffers: no engine, no sockets."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

from bridge import wire
from bridge.errors import ChecksumError, ManifestError, NonFiniteError, WireError
from inference_side.verify import verify_bucket
from tests.helpers import plan_manifest
from trainer_side.packing import PackPlan, dtype_name, iter_named, make_plan, pack_bucket, plan_specs


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("lm_head.weight", torch.randn(16, 8, generator=g)),
        ("model.layers.10.mlp.weight", torch.randn(8, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g)),
        ("model.layers.2.self_attn.sinks", torch.randn(4, generator=g, dtype=torch.float64)),
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),
        ("model.layers.2.mlp.weight", torch.randn(8, 8, generator=g, dtype=torch.float16)),
        ("model.layers.2.step", torch.tensor(12345678901, dtype=torch.int64)),
        ("model.layers.10.mask", torch.tensor([True, False, True])),
    ]


def _pack_all(plan: PackPlan, tensors: list[Any], transform: Any = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    bufs, sums = [], []
    for index, size in enumerate(plan.bucket_sizes):
        out = torch.zeros(size, dtype=torch.uint8)
        sums.append(pack_bucket(plan, tensors, index, out, transform))
        bufs.append(out)
    return bufs, sums


def _read(buf: torch.Tensor, spec: wire.TensorSpec) -> torch.Tensor:
    raw = buf[spec.offset : spec.offset + spec.nbytes]
    return raw.view(getattr(torch, spec.dtype)).view(spec.shape)


# ---- make_plan ----------------------------------------------------------------------------------


def test_make_plan_orders_by_layer_and_casts_floats() -> None:
    named = _named()
    plan, tensors = make_plan(named, "bfloat16", 1 << 20)
    assert plan.names == (
        "model.embed_tokens.weight",
        "model.layers.2.self_attn.sinks", "model.layers.2.mlp.weight", "model.layers.2.step",
        "model.layers.10.mlp.weight", "model.layers.10.mask",
        "lm_head.weight", "model.norm.weight",
    )
    by_name = dict(named)
    assert all(t is by_name[n] for n, t in zip(plan.names, tensors, strict=True))  # not copied at plan time
    dtypes = dict(zip(plan.names, plan.dtypes, strict=True))
    assert dtypes["model.layers.2.self_attn.sinks"] == "bfloat16"  # float64 -> target
    assert dtypes["model.layers.2.mlp.weight"] == "bfloat16"  # float16 -> target
    assert dtypes["model.layers.2.step"] == "int64"  # integers keep their dtype
    assert dtypes["model.layers.10.mask"] == "bool"
    shapes = dict(zip(plan.names, plan.shapes, strict=True))
    assert shapes["model.layers.2.step"] == ()
    assert shapes["lm_head.weight"] == (16, 8)
    nbytes = {p.name: p.nbytes for p in plan.placements}
    assert nbytes["lm_head.weight"] == 16 * 8 * 2
    assert nbytes["model.layers.2.step"] == 8
    assert nbytes["model.layers.10.mask"] == 3


# bfloat16 sizes in layer order: embed 256, sinks 8, mlp.2 128, step 8, mlp.10 128, mask 3, lm_head 256, norm 16
@pytest.mark.parametrize(
    ("bucket_bytes", "sizes"),
    [
        (1 << 20, (976,)),  # all in one, each start aligned to 64
        (300, (264, 136, 131, 272)),
        (256, (256, 200, 131, 256, 16)),  # exact fit of the 256-byte embedding
        (1, (256, 8, 128, 8, 128, 3, 256, 16)),  # every tensor oversize: one bucket each
    ],
)
def test_make_plan_buckets(bucket_bytes: int, sizes: tuple[int, ...]) -> None:
    plan, _ = make_plan(_named(), "bfloat16", bucket_bytes)
    assert plan.bucket_sizes == sizes
    n_buckets = len(sizes)
    plan_manifest(plan).check_layout()
    members = [i for b in range(n_buckets) for i in plan.bucket_members(b)]
    assert members == list(range(len(plan.names)))  # every tensor in exactly one bucket, in order


def test_make_plan_rejects_duplicate_names() -> None:
    named = [("a.weight", torch.zeros(2)), ("b.weight", torch.zeros(2)), ("a.weight", torch.ones(2))]
    with pytest.raises(ManifestError, match="duplicate tensor name 'a.weight' in the published weights"):
        make_plan(named, "float32", 1024)


@pytest.mark.parametrize(
    ("tensor", "target", "phrase"),
    [
        (torch.zeros(2, dtype=torch.complex64), "float32", "dtype complex64 cannot travel"),
        (torch.zeros(2), "float4", "dtype float4 cannot travel"),
        (torch.zeros(2, dtype=torch.uint16), "float32", "dtype uint16 cannot travel"),
    ],
)
def test_make_plan_rejects_untravelled_dtypes(tensor: torch.Tensor, target: str, phrase: str) -> None:
    with pytest.raises(ManifestError) as info:
        make_plan([("model.x", tensor)], target, 1024)
    assert f"tensor model.x: {phrase}" in str(info.value)


def test_dtype_name_and_iter_named() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    sd = {"a": torch.zeros(1), "b": torch.ones(1)}
    assert [n for n, _ in iter_named(sd)] == ["a", "b"]
    assert [n for n, _ in iter_named(list(sd.items()))] == ["a", "b"]
    module = torch.nn.Linear(2, 3)
    assert [n for n, _ in iter_named(module.named_parameters())] == ["weight", "bias"]


# ---- pack_bucket + verify_bucket ----------------------------------------------------------------


@pytest.mark.parametrize("target", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 200])
def test_pack_then_verify_round_trip(target: str, bucket_bytes: int) -> None:
    named = _named(1)
    plan, tensors = make_plan(named, target, bucket_bytes)
    manifest = plan_manifest(plan)
    manifest.check_layout()
    bufs, sums = _pack_all(plan, tensors)
    by_name = dict(named)
    for index, specs in enumerate(manifest.by_bucket()):
        assert len(sums[index]) == len(specs)
        for spec, crc in zip(specs, sums[index], strict=True):
            got = _read(bufs[index], spec)
            src = by_name[spec.name]
            assert torch.equal(got, src.to(got.dtype)), spec.name  # bytes are the cast tensor
            assert crc == zlib.crc32(bufs[index][spec.offset : spec.offset + spec.nbytes].numpy().tobytes())
        view = memoryview(bytearray(bufs[index].numpy().tobytes()))
        verify_bucket(view, specs, tuple(sums[index]), "reject")
        # a wire round trip of the header keeps the checksums
        header = wire.decode(wire.encode(wire.BucketHeader(version=1, index=index, checksums=tuple(sums[index]))))
        verify_bucket(view, specs, header.checksums, "reject")  # type: ignore[union-attr]


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3", "crc32c"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("source", ["float32", "bfloat16"])
def test_pack_checksums_tensors_spanning_many_chunks(algorithm: str, layout: str, source: str) -> None:
    """Packing copies and sums large tensors chunk by chunk (cast by torch, or copied as bytes when the
    source already has the wire dtype); the checksum is still the algorithm's value over the tensor's
    bytes as written, down to a last chunk shorter than the rest."""
    from bridge.checksums import function
    from trainer_side import packing

    try:
        whole = function(algorithm)
    except WireError:
        pytest.skip(f"{algorithm} is not installed here")
    chunk_elems = packing.PACK_CHUNK_BYTES // 2
    big = torch.randn(3 * chunk_elems + 1234, dtype=torch.float32).reshape(-1, 2).to(getattr(torch, source))  # 3.x chunks
    src = big.t().contiguous().t() if layout == "transposed" else big
    assert src.is_contiguous() == (layout == "contiguous")
    named = [("model.layers.0.mlp.weight", src), ("model.layers.0.bias", torch.randn(7))]
    plan, tensors = make_plan(named, "bfloat16", 64 << 20)
    bufs, sums = _pack_all_with(plan, tensors, algorithm)
    for spec, got in zip(plan_manifest(plan).by_bucket()[0], sums[0], strict=True):
        raw = bufs[0][spec.offset : spec.offset + spec.nbytes]
        assert got == whole(raw.numpy().tobytes()), spec.name
        assert torch.equal(raw.view(torch.bfloat16).view(spec.shape), dict(named)[spec.name].to(torch.bfloat16)), spec.name


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("elements", [1, 1000, 4096, 4097])
def test_device_copy_overlapped_with_the_sum_writes_and_sums_every_chunk(layout: str, elements: int, monkeypatch: Any) -> None:
    """The GPU path (copy chunk k+1 on a helper thread while chunk k is summed), run here on a CPU tensor
    with 2 KiB chunks: every byte lands cast, and the checksum is the algorithm's over the tensor as written
    (one chunk, a chunk boundary exactly, one element past it). On a GPU: tests/test_gpu_trainer_tensors.py."""
    from bridge.checksums import function, running
    from trainer_side import packing

    monkeypatch.setattr(packing, "DEVICE_CHUNK_BYTES", 2048)
    src = torch.randn(2, elements, dtype=torch.float32)
    src = src.t() if layout == "transposed" else src
    dst = torch.zeros(src.numel() * 2, dtype=torch.uint8)
    got = packing._copy_from_device_and_sum(dst.view(torch.bfloat16), memoryview(dst.numpy()), src, running("crc32")())
    assert torch.equal(dst.view(torch.bfloat16).view(src.shape), src.to(torch.bfloat16))
    assert got == function("crc32")(dst.numpy().tobytes())


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3", "crc32c"])
def test_an_empty_tensor_checksums_as_the_receiver_verifies_it(algorithm: str) -> None:
    """A zero-element tensor's checksum is the algorithm's value over no bytes (xxh3 of b"" is not 0), so
    the receiver's verification accepts a bucket holding one."""
    from bridge.checksums import function

    try:
        empty = function(algorithm)(b"")
    except WireError:
        pytest.skip(f"{algorithm} is not installed here")
    named = [("model.layers.0.mlp.weight", torch.randn(4, 8)), ("model.layers.0.mlp.empty", torch.empty(0, 8)),
             ("model.layers.0.mlp.steps", torch.empty(0, dtype=torch.int64))]
    plan, tensors = make_plan(named, "bfloat16", 64 << 20)
    bufs, sums = _pack_all_with(plan, tensors, algorithm)
    specs = plan_manifest(plan).by_bucket()[0]
    assert [s for spec, s in zip(specs, sums[0], strict=True) if spec.nbytes == 0] == [empty, empty]
    verify_bucket(memoryview(bytearray(bufs[0].numpy().tobytes())), specs, tuple(sums[0]), "reject", algorithm)


def _pack_all_with(plan: PackPlan, tensors: list[Any], algorithm: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    bufs, sums = [], []
    for index, size in enumerate(plan.bucket_sizes):
        out = torch.zeros(size, dtype=torch.uint8)
        sums.append(pack_bucket(plan, tensors, index, out, checksum=algorithm))
        bufs.append(out)
    return bufs, sums


def test_pack_non_contiguous_and_grad_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    param = torch.nn.Parameter(torch.ones(4) * 3)  # requires grad
    named = [("model.layers.0.w", base.t()), ("model.layers.0.p", param)]
    plan, tensors = make_plan(named, "float32", 4096)
    (buf,), (sums,) = _pack_all(plan, tensors)
    specs = list(plan_specs(plan))
    assert torch.equal(_read(buf, specs[0]), base.t().contiguous())
    assert specs[0].shape == (4, 3)
    assert torch.equal(_read(buf, specs[1]), torch.full((4,), 3.0))
    verify_bucket(memoryview(buf.numpy()), specs, tuple(sums), "reject")


class FakeDTensor:
    """Just enough of a DTensor: materialised with full_tensor() at pack time."""

    def __init__(self, full: torch.Tensor) -> None:
        self._full = full
        self.dtype, self.shape = full.dtype, full.shape
        self.materialised = 0

    def is_floating_point(self) -> bool:
        return self._full.is_floating_point()

    def full_tensor(self) -> torch.Tensor:
        self.materialised += 1
        return self._full


def test_pack_materialises_dtensors_at_send_time() -> None:
    dt = FakeDTensor(torch.tensor([1.0, 2.0, 3.0]))
    plan, tensors = make_plan([("model.layers.0.w", dt)], "float32", 1024)
    assert dt.materialised == 0  # planning touches no bytes
    (buf,), _ = _pack_all(plan, tensors)
    assert dt.materialised == 1
    assert _read(buf, plan_specs(plan)[0]).tolist() == [1.0, 2.0, 3.0]


def test_pack_transform_is_applied_and_checksummed() -> None:
    named = [("model.layers.0.w", torch.tensor([1.0, 2.0])), ("model.layers.0.v", torch.tensor([5.0]))]
    plan, tensors = make_plan(named, "float32", 1024)
    seen: list[str] = []

    def double(name: str, t: torch.Tensor) -> torch.Tensor:
        seen.append(name)
        return t * 2

    (buf,), (sums,) = _pack_all(plan, tensors, double)
    specs = plan_specs(plan)
    assert seen == ["model.layers.0.w", "model.layers.0.v"]
    assert _read(buf, specs[0]).tolist() == [2.0, 4.0]
    assert _read(buf, specs[1]).tolist() == [10.0]
    verify_bucket(memoryview(buf.numpy()), list(specs), tuple(sums), "reject")


def test_pack_zero_element_tensor() -> None:
    named = [("model.layers.0.empty", torch.zeros(0, 4)), ("model.layers.0.w", torch.tensor([1.0]))]
    plan, tensors = make_plan(named, "float32", 1024)
    (buf,), (sums,) = _pack_all(plan, tensors)
    assert sums[0] == 0
    specs = list(plan_specs(plan))
    assert specs[0].nbytes == 0
    verify_bucket(memoryview(buf.numpy()), specs, tuple(sums), "reject")


# ---- verify_bucket failures ---------------------------------------------------------------------


def _bucket(values: dict[str, torch.Tensor]) -> tuple[bytearray, list[wire.TensorSpec], tuple[int, ...]]:
    """Lay tensors (already in their travel dtype) out at 64-byte offsets; return bytes, specs, checksums."""
    buf = bytearray()
    specs, sums = [], []
    for name, t in values.items():
        buf.extend(b"\0" * (-len(buf) % 64))
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        specs.append(wire.TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), 0, len(buf), len(raw)))
        sums.append(zlib.crc32(raw))
        buf.extend(raw)
    return buf, specs, tuple(sums)


def test_verify_detects_flipped_byte() -> None:
    buf, specs, sums = _bucket({"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(4, dtype=torch.bfloat16)})
    verify_bucket(memoryview(buf), specs, sums, "reject")
    buf[specs[1].offset + 3] ^= 0x01
    with pytest.raises(ChecksumError, match=r"tensor b: checksum mismatch \(got 0x[0-9a-f]{8}, manifest says 0x[0-9a-f]{8}\)"):
        verify_bucket(memoryview(buf), specs, sums, "reject")


def test_verify_ignores_padding_bytes() -> None:
    buf, specs, sums = _bucket({"a": torch.ones(3, dtype=torch.float32), "b": torch.ones(2, dtype=torch.float32)})
    assert specs[1].offset == 64
    buf[20] = 0xFF  # between a's end (12) and b's start (64)
    verify_bucket(memoryview(buf), specs, sums, "reject")


def test_verify_detects_truncated_buffer() -> None:
    buf, specs, sums = _bucket({"a": torch.ones(3), "b": torch.ones(2)})
    with pytest.raises(ChecksumError, match="tensor b: checksum mismatch"):
        verify_bucket(memoryview(buf[:-1]), specs, sums, "reject")


def test_verify_wrong_checksum_count() -> None:
    buf, specs, sums = _bucket({"a": torch.ones(3), "b": torch.ones(2)})
    with pytest.raises(WireError, match="bucket 0: 1 checksums for 2 tensors") as info:
        verify_bucket(memoryview(buf), specs, sums[:1], "reject")
    assert not isinstance(info.value, ChecksumError)


def test_verify_pairs_checksums_in_manifest_order_not_offset_order() -> None:
    """Checksums travel in manifest order; tensors listed out of offset order must still pair up."""
    buf, specs, sums = _bucket({"a": torch.ones(3), "b": torch.full((2,), 2.0), "c": torch.arange(5.0)})
    order = [2, 0, 1]
    verify_bucket(memoryview(buf), [specs[i] for i in order], tuple(sums[i] for i in order), "reject")
    with pytest.raises(ChecksumError):
        verify_bucket(memoryview(buf), [specs[i] for i in order], sums, "reject")


BAD_FLOATS = [
    ("nan-f32", torch.tensor([1.0, float("nan")], dtype=torch.float32)),
    ("inf-f32", torch.tensor([float("inf"), 1.0], dtype=torch.float32)),
    ("neg-inf-bf16", torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)),
    ("nan-f16", torch.tensor([float("nan")], dtype=torch.float16)),
    ("nan-f64", torch.tensor([0.0, 0.0, float("nan")], dtype=torch.float64)),
    ("nan-fp8-e4m3", torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)),
    ("inf-fp8-e5m2", torch.tensor([float("inf"), 1.0]).to(torch.float8_e5m2)),
]


@pytest.mark.parametrize("bad", [b[1] for b in BAD_FLOATS], ids=[b[0] for b in BAD_FLOATS])
def test_verify_nonfinite_policy(bad: torch.Tensor) -> None:
    buf, specs, sums = _bucket({"ok": torch.ones(4), "model.bad": bad})
    with pytest.raises(NonFiniteError, match=r"tensor model.bad: holds NaN or Inf \(policy sync.nonfinite=reject\)"):
        verify_bucket(memoryview(buf), specs, sums, "reject")
    verify_bucket(memoryview(buf), specs, sums, "allow")  # the same bytes pass under allow


@pytest.mark.parametrize(
    "t",
    [torch.tensor([-1, 0, 2**31 - 1], dtype=torch.int32), torch.tensor([255, 0], dtype=torch.uint8),
     torch.tensor([True, False]), torch.tensor([1.0, -1.0, 65504.0], dtype=torch.float16),
     torch.tensor([448.0, -448.0]).to(torch.float8_e4m3fn)],
    ids=["int32", "uint8-ff", "bool", "f16-max", "fp8-max"],
)
def test_verify_finite_and_non_float_pass(t: torch.Tensor) -> None:
    buf, specs, sums = _bucket({"x": t})
    verify_bucket(memoryview(buf), specs, sums, "reject")
    assert sums[0] == zlib.crc32(bytes(buf[specs[0].offset : specs[0].offset + specs[0].nbytes]))


def test_pack_of_nan_is_refused_by_receiver() -> None:
    named = [("model.layers.0.w", torch.tensor([1.0, float("nan")])), ("model.norm.weight", torch.ones(2))]
    plan, tensors = make_plan(named, "bfloat16", 1024)
    (buf,), (sums,) = _pack_all(plan, tensors)
    with pytest.raises(NonFiniteError, match="model.layers.0.w"):
        verify_bucket(memoryview(buf.numpy()), list(plan_specs(plan)), tuple(sums), "reject")
