"""Ranges of sharded tensors (bridge/shards.py, trainer_side/shard_view.py): blocks as torch computes them,
every placement's ranges covering each tensor exactly once and reassembling to its bytes, the cover check's
refusals each naming tensor, interval and rank, the manifest on the wire, and real ranks (FSDP2 over gloo)
sending their own shards without gathering."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from bridge.errors import ManifestError
from bridge.report import FailureKind
from bridge.shards import (
    LocalShard,
    RangeSpec,
    RankPlan,
    ShardError,
    ShardManifest,
    TensorHeader,
    agree,
    check_cover,
    local_plan,
    plan_ranges,
    shard_of_placements,
)
from tests.helpers import ROOT, free_port_in

SHAPES = [(7, 5), (8, 4), (3,), (1, 6), (0, 4), (2, 3, 5), (5, 1), ()]
# (mesh shape, placements): one mesh dim, and two (HSDP-like Replicate + Shard, 2-D sharding, inner dims)
LAYOUTS_1D = [[("shard", 0)], [("shard", 1)], [("replicate",)]]
LAYOUTS_2D = [
    ((2, 2), [("replicate",), ("shard", 0)]),
    ((2, 2), [("shard", 0), ("shard", 1)]),
    ((2, 3), [("shard", 0), ("shard", 0)]),
    ((3, 2), [("shard", 1), ("shard", 2)]),
    ((2, 2), [("shard", 2), ("replicate",)]),
]


def _torch_placements(placements: list[Any]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(p[1]) if p[0] == "shard" else Replicate() for p in placements]


def _coords(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*(range(n) for n in mesh)))


def _blocks(name: str, dtype: str, shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Any]) -> list[LocalShard]:
    return [shard_of_placements(name, dtype, shape, mesh, c, placements, rank) for rank, c in enumerate(_coords(mesh))]


def _cases() -> list[Any]:
    cases = []
    for shape in SHAPES:
        for world in (1, 2, 3, 4):
            for placements in LAYOUTS_1D:
                if placements[0][0] == "shard" and placements[0][1] >= len(shape):
                    continue
                cases.append(pytest.param(shape, (world,), placements, id=f"{list(shape)}-w{world}-{placements[0]}"))
        for mesh, placements in LAYOUTS_2D:
            if all(p[0] == "replicate" or p[1] < len(shape) for p in placements):
                cases.append(pytest.param(shape, mesh, placements, id=f"{list(shape)}-m{list(mesh)}-{placements}"))
    return cases


@pytest.mark.parametrize(("shape", "mesh", "placements"), _cases())
def test_blocks_are_torchs(shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Any]) -> None:
    """shard_of_placements gives every coordinate the local shape and offset torch gives (uneven and empty
    chunks included)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    for block, coord in zip(_blocks("t", "float32", shape, mesh, placements), _coords(mesh), strict=True):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), _torch_placements(placements))
        assert (block.local_shape, block.offset) == (tuple(local), tuple(offset))


def _full(shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    gen = torch.Generator().manual_seed(math.prod(shape) + len(shape))
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


def _local(full: Any, block: LocalShard) -> Any:
    """What a DTensor's to_local() holds: the block of the full tensor, its own contiguous tensor."""
    index = tuple(slice(o, o + n) for o, n in zip(block.offset, block.local_shape, strict=True))
    return full[index].clone()


def _reassemble(total: int, sent: list[tuple[RangeSpec, bytes]]) -> bytes:
    """What a receiver lays out: each range's bytes run by run at their offsets; every byte written once."""
    out, times = bytearray(total), bytearray(total)
    for spec, data in sent:
        assert len(data) == spec.nbytes
        at = 0
        for start, end in spec.runs():
            out[start:end] = data[at : at + end - start]
            for i in range(start, end):
                times[i] += 1
            at += end - start
    assert set(times) <= {1}, "a byte was written twice or never"
    return bytes(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("shape", "mesh", "placements"), _cases())
def test_ranges_cover_once_and_reassemble(shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Any], dtype: str) -> None:
    """Every rank's ranges, with the bytes its local shard yields for them, make the full tensor's bytes:
    each byte sent by exactly one rank; a replicated block by its replica 0 only."""
    import torch

    from trainer_side.shard_view import range_views

    full = _full(shape, dtype)
    blocks = _blocks("t", dtype, shape, mesh, placements)
    sent = [(spec, bytes(view.numpy())) for b in blocks for spec, view in range_views(b, _local(full, b))]
    total = full.numel() * full.element_size()
    check_cover([s for s, _ in sent], total, range(len(blocks)))
    assert {s.rank for s, _ in sent} <= {b.rank for b in blocks if b.replica == 0}
    expected = bytes(full.reshape(-1).view(torch.uint8).numpy()) if full.dim() else bytes(full.reshape(1).view(torch.uint8).numpy())
    assert _reassemble(total, sent) == expected
    manifest = agree([local_plan(b.rank, [b]) for b in blocks], len(blocks))
    assert sorted(manifest.ranges, key=lambda r: (r.offset, r.rank)) == sorted((s for s, _ in sent), key=lambda r: (r.offset, r.rank))


@pytest.mark.parametrize(("placements", "ranges_per_rank", "strided"), [
    ([("shard", 0)], 1, False),
    ([("shard", 1)], 1, True),  # one strided range per rank, not one per row
    ([("shard", 2)], 1, True),  # dims 0 and 1 are full: one progression
])
def test_ranges_per_rank_stay_few(placements: list[Any], ranges_per_rank: int, strided: bool) -> None:
    """The manifest grows with ranks, not rows: a single sharded dim gives each rank one range."""
    for block in _blocks("w", "bfloat16", (64, 32, 16), (4,), placements):
        ranges = plan_ranges(block)
        assert len(ranges) == ranges_per_rank
        assert bool(ranges[0].run) == strided


def test_non_contiguous_local_is_laid_out() -> None:
    """A local shard that is a transposed view is sent as its row-major bytes (one copy of that shard)."""
    import torch

    from trainer_side.shard_view import range_views

    full = _full((6, 4), "float32")
    block = LocalShard("t", "float32", (6, 4), (0, 2), (6, 2), 0)
    local = full[:, 2:4].t().contiguous().t()  # the right values, column-major
    assert not local.is_contiguous()
    (spec, view), = list(range_views(block, local))
    assert bytes(view.numpy()) == bytes(full[:, 2:4].contiguous().view(torch.uint8).numpy())
    assert (spec.offset, spec.nbytes, spec.run, spec.stride) == (8, 48, 8, 16)


def _r(rank: int, offset: int, nbytes: int, run: int = 0, stride: int = 0) -> RangeSpec:
    return RangeSpec("layers.0.w", rank, offset, nbytes, 0, run, stride)


@pytest.mark.parametrize(("ranges", "words", "ranks"), [
    pytest.param([_r(0, 0, 40), _r(1, 48, 52)], ["bytes [40, 48)", "no rank"], (), id="gap"),
    pytest.param([_r(0, 0, 60)], ["bytes [60, 100)", "no rank"], (), id="gap-at-end"),
    pytest.param([_r(0, 0, 60), _r(1, 50, 50)], ["bytes [50, 60)", "rank 0", "rank 1"], (0, 1), id="overlap"),
    pytest.param([_r(0, 0, 50, 10, 20), _r(1, 10, 50, 10, 20), _r(2, 30, 10)],
                 ["bytes [30, 40)", "rank 1", "rank 2"], (1, 2), id="overlap-strided"),
    pytest.param([_r(0, 0, 50), _r(7, 50, 50)], ["rank 7", "bytes [50, 100)", "0..3"], (7,), id="unknown-rank"),
    pytest.param([_r(0, 0, 50), _r(1, 50, 60)], ["rank 1", "bytes [50, 110)", "past the tensor's end"], (1,), id="past-end"),
    pytest.param([_r(0, 0, 50, 10, 20), _r(1, 10, 50, 10, 21)], ["past the tensor's end", "rank 1"], (1,), id="past-end-strided"),
])
def test_cover_refusals_name_tensor_interval_and_ranks(ranges: list[RangeSpec], words: list[str], ranks: tuple[int, ...]) -> None:
    with pytest.raises(ShardError) as err:
        check_cover(ranges, 100, range(4))
    assert "tensor layers.0.w" in str(err.value)
    for word in words:
        assert word in str(err.value)
    assert err.value.ranks == ranks and err.value.tensor == "layers.0.w"
    assert err.value.kind is FailureKind.MANIFEST and isinstance(err.value, ManifestError)


def test_cover_accepts_interleaved_strided_ranges() -> None:
    check_cover([_r(0, 0, 50, 10, 20), _r(1, 10, 50, 10, 20)], 100, range(2))


def _plans() -> list[RankPlan]:
    blocks = _blocks("layers.0.w", "float32", (5, 3), (2,), [("shard", 0)])
    return [local_plan(b.rank, [b]) for b in blocks]


def test_agree_refusals_name_the_rank() -> None:
    plans = _plans()
    with pytest.raises(ShardError, match=r"no plan from rank\(s\) 1 of 2") as err:
        agree(plans[:1], 2)
    assert err.value.ranks == (1,)
    with pytest.raises(ShardError, match="rank 0 sent two plans"):
        agree([plans[0], plans[0]], 2)
    with pytest.raises(ShardError, match="not one of the ranks 0..1"):
        agree([*plans, RankPlan(2, (), ())], 2)
    other = RankPlan(1, (TensorHeader("layers.0.w", "float32", (5, 4)),), plans[1].ranges)
    with pytest.raises(ShardError, match=r"rank 0 has float32 \[5, 3\], rank 1 has float32 \[5, 4\]") as err:
        agree([plans[0], other], 2)
    assert err.value.ranks == (0, 1)
    stolen = RankPlan(1, plans[1].tensors, (*plans[1].ranges, plans[0].ranges[0]))
    with pytest.raises(ShardError, match="rank 1's plan holds bytes \\[0, 36\\) for rank 0"):
        agree([plans[0], stolen], 2)
    sends_own = RankPlan(1, plans[1].tensors, (*plans[1].ranges, _r(1, 0, 12)))
    with pytest.raises(ShardError, match=r"bytes \[0, 12\) are sent by both rank 0 and rank 1") as err:
        agree([plans[0], sends_own], 2)
    assert err.value.ranks == (0, 1)
    silent = RankPlan(1, plans[1].tensors, ())
    with pytest.raises(ShardError, match=r"bytes \[36, 60\) are sent by no rank"):
        agree([plans[0], silent], 2)


@pytest.mark.parametrize("placement", [("partial",), ("_StridedShard",), ("shard", 3)])
def test_placements_that_are_not_byte_ranges_are_refused(placement: Any) -> None:
    with pytest.raises(ShardError, match="is not a byte range"):
        shard_of_placements("w", "float32", (4, 4), (2,), (1,), [placement], 1)


def test_manifest_round_trips_and_is_checked_on_arrival() -> None:
    blocks = [b for mesh, pl in [((2,), [("shard", 1)])] for b in _blocks("layers.1.w", "bfloat16", (3, 5), mesh, pl)]
    blocks += _blocks("embed.w", "float32", (4, 2), (2,), [("replicate",)])
    manifest = agree([local_plan(r, [b for b in blocks if b.rank == r]) for r in range(2)], 2)
    assert [t.name for t in manifest.tensors] == ["embed.w", "layers.1.w"]  # layer order
    raw = msgpack.unpackb(msgpack.packb(manifest.to_wire()))
    assert ShardManifest.from_wire(raw) == manifest
    raw["ranges"] = raw["ranges"][:-1]
    with pytest.raises(ShardError, match="tensor layers.1.w: bytes .* are sent by no rank"):
        ShardManifest.from_wire(raw)


@pytest.mark.parametrize(("raw", "words"), [
    ({"name": "w", "rank": 0, "offset": 0, "nbytes": 0}, "nbytes"),
    ({"name": "w", "rank": 0, "offset": 0, "nbytes": 30, "run": 10, "stride": 10}, "stride > run"),
    ({"name": "w", "rank": 0, "offset": 0, "nbytes": 30, "run": 7, "stride": 10}, "multiple of run"),
    ({"name": "w", "rank": 0, "offset": 0, "nbytes": 30, "stride": 10}, "no stride"),
    ({"name": "w", "rank": -1, "offset": 0, "nbytes": 3}, "rank"),
    ({"name": "", "rank": 0, "offset": 0, "nbytes": 3}, "name"),
])
def test_range_from_wire_refuses_malformed(raw: dict[str, Any], words: str) -> None:
    from bridge.errors import WireError

    with pytest.raises(WireError, match=words):
        RangeSpec.from_wire(raw)


def _free_port() -> int:
    port = free_port_in(range(27930, 27950))
    if port is None:
        pytest.skip("no free port in 27930-27949")
    return port


def test_fsdp2_ranks_send_their_own_shards(tmp_path: Any) -> None:
    """Two real ranks (gloo, CPU): a module under FSDP2 fully_shard (uneven dim-0 shards, an empty one), a
    Shard(1) and a Replicate DTensor and a plain tensor. Each rank sends the ranges of its local shards with
    full_tensor and redistribute made to raise; rank 0 agrees the manifest from all_gather_object; the
    bytes, laid out at their ranges, are the unsharded module's state dict."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.shard_worker import build_model, extra_tensors

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "shard_worker.py"), str(r), "2", str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0]["placements"]["layers.0.weight"] == ["S(0)"] and results[0]["placements"]["extra.col"] == ["S(1)"]
    manifest = ShardManifest.from_wire(results[0]["manifest"])
    expected = {**build_model().state_dict(), **extra_tensors()}
    assert {t.name for t in manifest.tensors} == set(expected)
    sent = [(RangeSpec.from_wire(s), data) for res in results for s, data in zip(res["ranges"], res["bytes"], strict=True)]
    def key(r: RangeSpec) -> tuple[str, int]:
        return r.name, r.offset

    assert sorted((s for s, _ in sent), key=key) == sorted(manifest.ranges, key=key)  # checksums too
    from bridge.checksums import function

    crc = function("crc32")
    assert all(crc(data) == s.checksum for s, data in sent)
    assert not [s for s, _ in sent if s.name in ("extra.rep", "plain.buf") and s.rank != 0]  # replicated: sent once
    assert not [s for s, _ in sent if s.name == "row" and s.rank == 1]  # rank 1's shard of the 1-row param is empty
    for header in manifest.tensors:
        full = expected[header.name].contiguous()
        mine = [(s, d) for s, d in sent if s.name == header.name]
        assert _reassemble(header.nbytes, mine) == bytes(full.reshape(-1).view(torch.uint8).numpy()), header.name
