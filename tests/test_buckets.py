"""Pure bucket planning and layer ordering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge import wire
from bridge.buckets import Placement, align_up, layer_index, layer_order_key, order_by_layer, plan_buckets
from bridge.errors import ManifestError

# ---- layer_index / ordering ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),
        ("model.layers.10.mlp.down_proj.weight", 10),
        ("layers.7.attn.sinks", 7),
        ("transformer.h.2.attn.c_attn.weight", 2),
        ("model.blocks.31.norm.weight", 31),
        ("encoder.layer.3.output.dense.bias", 3),
        ("model.embed_tokens.weight", None),
        ("model.norm.weight", None),
        ("lm_head.weight", None),
        ("model.layers.weight", None),  # no index
        ("model.sublayers.3.weight", None),  # 'layers' only as a whole path component
        ("model.layers.4", None),  # an index must be followed by a component
    ],
)
def test_layer_index(name: str, index: int | None) -> None:
    assert layer_index(name) == index


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        # embeddings first, layers by numeric index (10 after 2), norm and head last
        (
            ["lm_head.weight", "model.layers.10.mlp.weight", "model.norm.weight", "model.layers.2.mlp.weight",
             "model.embed_tokens.weight", "model.layers.1.mlp.weight"],
            ["model.embed_tokens.weight", "model.layers.1.mlp.weight", "model.layers.2.mlp.weight",
             "model.layers.10.mlp.weight", "lm_head.weight", "model.norm.weight"],
        ),
        # stable within a layer and within the trailing group
        (
            ["model.layers.0.b", "model.norm.weight", "model.layers.0.a", "lm_head.weight", "model.layers.0.c"],
            ["model.layers.0.b", "model.layers.0.a", "model.layers.0.c", "model.norm.weight", "lm_head.weight"],
        ),
        # 100 layers: numeric, not lexicographic
        (
            [f"model.layers.{i}.w" for i in (99, 9, 10, 1, 0, 11, 2, 100)],
            [f"model.layers.{i}.w" for i in (0, 1, 2, 9, 10, 11, 99, 100)],
        ),
        (["transformer.wte.embed", "transformer.h.1.x", "transformer.h.0.x"],
         ["transformer.wte.embed", "transformer.h.0.x", "transformer.h.1.x"]),
        ([], []),
    ],
    ids=["dense", "stable", "numeric", "gpt2-style", "empty"],
)
def test_order_by_layer(names: list[str], expected: list[str]) -> None:
    order = order_by_layer(names)
    assert sorted(order) == list(range(len(names)))  # a permutation
    assert [names[i] for i in order] == expected


def test_layer_order_key_groups() -> None:
    assert layer_order_key("model.embed_tokens.weight") < layer_order_key("model.layers.0.x")
    assert layer_order_key("model.layers.2.x") < layer_order_key("model.layers.10.x")
    assert layer_order_key("model.layers.999.x") < layer_order_key("model.norm.weight")
    assert layer_order_key("model.norm.weight") == layer_order_key("lm_head.weight")


# ---- align_up -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "align", "expected"), [(0, 64, 0), (1, 64, 64), (63, 64, 64), (64, 64, 64), (65, 64, 128),
                                                      (5, 8, 8), (16, 8, 16)])
def test_align_up(n: int, align: int, expected: int) -> None:
    assert align_up(n, align) == expected


def test_align_default_is_wire_align() -> None:
    assert wire.ALIGN == 64
    assert align_up(1) == 64


# ---- plan_buckets -------------------------------------------------------------------------------

PLANS = [
    # (entries, bucket_bytes, placements as (bucket, offset), bucket sizes)
    ("two-small", [("a", 10), ("b", 10)], 100, [(0, 0), (0, 64)], [74]),
    ("aligned-to-64", [("a", 1), ("b", 1), ("c", 1)], 1000, [(0, 0), (0, 64), (0, 128)], [129]),
    ("exact-fit", [("a", 64), ("b", 36)], 100, [(0, 0), (0, 64)], [100]),
    ("one-byte-over", [("a", 64), ("b", 37)], 100, [(0, 0), (1, 0)], [64, 37]),
    ("alignment-pushes-over", [("a", 10), ("b", 40)], 100, [(0, 0), (1, 0)], [10, 40]),
    ("oversize-alone", [("a", 10), ("big", 500), ("c", 10)], 100, [(0, 0), (1, 0), (2, 0)], [10, 500, 10]),
    ("oversize-first", [("big", 500), ("a", 10), ("b", 10)], 100, [(0, 0), (1, 0), (1, 64)], [500, 74]),
    ("two-oversize", [("x", 300), ("y", 300)], 100, [(0, 0), (1, 0)], [300, 300]),
    ("zero-size", [("a", 0), ("b", 10)], 100, [(0, 0), (0, 0)], [10]),
    ("zero-size-then-oversize", [("a", 0), ("big", 500)], 100, [(0, 0), (0, 0)], [500]),  # no empty bucket
    ("zero-size-after-full", [("a", 100), ("z", 0)], 100, [(0, 0), (1, 0)], [100, 0]),
    ("empty", [], 100, [], []),
]


@pytest.mark.parametrize(("entries", "bucket_bytes", "where", "sizes"), [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_plan_buckets(entries: list[tuple[str, int]], bucket_bytes: int, where: list[tuple[int, int]], sizes: list[int]) -> None:
    placements, got_sizes = plan_buckets(entries, bucket_bytes)
    assert [(p.bucket, p.offset) for p in placements] == where
    assert got_sizes == sizes
    # order preserved, sizes carried through
    assert [(p.name, p.nbytes) for p in placements] == list(entries)
    assert all(p.offset % 64 == 0 for p in placements)


@pytest.mark.parametrize(("entries", "bucket_bytes", "phrase"), [
    ([("a", 1)], 0, "bucket_bytes must be > 0, got 0"),
    ([("a", 1)], -5, "bucket_bytes must be > 0, got -5"),
    ([("a", 1), ("b", -1)], 100, "tensor b: negative size -1"),
])
def test_plan_buckets_rejects(entries: list[tuple[str, int]], bucket_bytes: int, phrase: str) -> None:
    with pytest.raises(ValueError) as info:
        plan_buckets(entries, bucket_bytes)
    assert phrase in str(info.value)


def _check_plan(entries: list[tuple[str, int]], bucket_bytes: int, placements: list[Placement], sizes: list[int]) -> None:
    assert [(p.name, p.nbytes) for p in placements] == entries
    buckets_used = [p.bucket for p in placements]
    assert buckets_used == sorted(buckets_used)  # order preserved: buckets never go back
    assert set(buckets_used) == set(range(len(sizes)))  # no empty or skipped bucket
    for p in placements:
        assert p.offset % 64 == 0
        assert p.offset + p.nbytes <= sizes[p.bucket]
    for b, size in enumerate(sizes):
        members = [p for p in placements if p.bucket == b]
        assert size == max(p.offset + p.nbytes for p in members)  # no slack at the end
        if size > bucket_bytes:  # only an oversize tensor (after zero-size ones) may exceed the limit
            assert len([p for p in members if p.nbytes]) == 1
        offsets = [p.offset for p in members]
        assert offsets == sorted(offsets)
        for x, y in zip(members, members[1:], strict=False):
            assert x.offset + x.nbytes <= y.offset  # no overlap


@settings(max_examples=200, deadline=None, database=None)
@given(
    sizes=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 5000)), max_size=30),
    bucket_bytes=st.integers(1, 2000),
)
def test_plan_buckets_properties(sizes: list[int], bucket_bytes: int) -> None:
    entries = [(f"t{i}", n) for i, n in enumerate(sizes)]
    placements, bucket_sizes = plan_buckets(entries, bucket_bytes)
    _check_plan(entries, bucket_bytes, placements, bucket_sizes)
    # a plan is always a layout the receiver accepts
    specs = tuple(wire.TensorSpec(p.name, "uint8", (p.nbytes,), p.bucket, p.offset, p.nbytes) for p in placements)
    try:
        wire.Manifest(version=1, tensors=specs, bucket_sizes=tuple(bucket_sizes)).check_layout()
    except ManifestError as exc:  # pragma: no cover - the assertion is the point
        raise AssertionError(f"plan_buckets produced a layout check_layout rejects: {exc}") from exc
