"""Pure planning for trainers that publish from many ranks: which rank sends which bytes of which tensor.

The model (docs/multi_rank.md). A tensor is addressed as its full row-major bytes, ``[0, nbytes)``, whatever
the trainer's sharding. Each rank describes its local shard of each tensor as a block: the global index of
its first element per dim (``offset``) and its ``local_shape`` (what torch's
``compute_local_shape_and_global_offset`` gives; :func:`shard_of_placements` computes the same from mesh
shape, coordinate and placements, with torch's chunk semantics). :func:`plan_ranges` turns a block into
:class:`RangeSpec` s, each one the bytes one rank sends:

* a dim-0 shard (``Shard(0)``, uneven included) is one contiguous byte interval of the full tensor;
* a shard of an inner dim (``Shard(1)``, ...) is a *strided* range: ``count`` runs of ``run`` bytes, the run
  starts ``stride`` bytes apart in the full tensor. Its bytes on the wire are the runs concatenated, which
  is the local shard's own row-major bytes: the sender sends its local tensor as it is (no gather, no
  copy when it is contiguous) and the receiver lays the runs out, one strided copy per range. A block
  whose leading dims are partial too (two inner dims sharded, ``Shard(1)`` and ``Shard(2)`` of a 3-D tensor)
  becomes one such range per index of those leading dims, each still a contiguous slice of the local shard;
* a replicated block (``Replicate`` on a mesh dim, or a plain tensor present on every rank) is sent once,
  by the replica with the lowest coordinate on the replicating mesh dims (``replica == 0``); the others
  plan nothing for it;
* ``Partial`` (and the ``_StridedShard`` FSDP2 uses over tensor parallelism) are not byte ranges of the
  full tensor: :class:`ShardError`.

A rank's :class:`RankPlan` lists the tensors it knows and the ranges it sends; :func:`agree` merges every
rank's plan (what rank 0 gathers with ``all_gather_object``) into one :class:`ShardManifest` and validates
it: every rank present once, the ranks agree on each tensor's dtype and shape, and :func:`check_cover`
holds for every tensor. Every refusal is a :class:`ShardError` naming the tensor, the byte interval and the
rank(s).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from bridge.buckets import order_by_layer, plan_buckets
from bridge.errors import ManifestError, WireError
from bridge.report import FailureKind
from bridge.wire import DTYPE_SIZES, MAX_NDIM, TensorSpec

MAX_RANKS = 1 << 20


class ShardError(ManifestError):
    """Ranks' shards do not make up the tensors exactly once: a gap, an overlap, a range past a tensor's end,
    an unknown or missing rank, ranks disagreeing on a tensor, or a placement that is not a byte range.
    ``tensor`` and ``ranks`` name what was wrong (``ranks`` empty when no rank is to blame, as for a gap)."""

    kind: ClassVar[FailureKind] = FailureKind.MANIFEST

    def __init__(self, message: str, tensor: str = "", ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.ranks: tuple[int, ...] = tuple(sorted(set(ranks)))


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise WireError(f"{what} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return int(value)


@dataclass(frozen=True)
class RangeSpec:
    """Bytes of tensor ``name`` that ``rank`` sends, addressed in the full row-major tensor.

    Contiguous when ``run`` is 0: the interval ``[offset, offset + nbytes)``. Strided otherwise: ``count``
    runs of ``run`` bytes, run ``i`` at ``offset + i * stride`` (``run < stride``, ``nbytes`` a multiple of
    ``run``). On the wire the runs travel concatenated, in order; ``checksum`` (the manifest's algorithm) is
    over those ``nbytes`` bytes as sent, 0 until the sender has summed them."""

    name: str
    rank: int
    offset: int
    nbytes: int
    checksum: int = 0
    run: int = 0
    stride: int = 0

    @property
    def count(self) -> int:
        return self.nbytes // self.run if self.run else 1

    @property
    def end(self) -> int:
        """One past the last byte of the full tensor this range touches."""
        return self.offset + (self.count - 1) * self.stride + (self.run or self.nbytes)

    def runs(self) -> Iterator[tuple[int, int]]:
        """The ``[start, end)`` byte intervals of the full tensor, in wire order."""
        if not self.run:
            yield self.offset, self.offset + self.nbytes
            return
        for i in range(self.count):
            start = self.offset + i * self.stride
            yield start, start + self.run

    def describe(self) -> str:
        if not self.run:
            return f"bytes [{self.offset}, {self.end})"
        return f"bytes [{self.offset}, {self.end}) ({self.count} runs of {self.run} every {self.stride})"

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "offset": self.offset, "nbytes": self.nbytes,
                "checksum": self.checksum, "run": self.run, "stride": self.stride}

    @classmethod
    def from_wire(cls, raw: Any) -> RangeSpec:
        if not isinstance(raw, dict):
            raise WireError(f"a range must be a map, got {type(raw).__name__}")
        name = raw.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 1024:
            raise WireError(f"range name must be a non-empty string, got {name!r:.80}")
        spec = cls(
            name=name,
            rank=_int(raw.get("rank"), f"range of {name}: rank", 0, MAX_RANKS),
            offset=_int(raw.get("offset"), f"range of {name}: offset"),
            nbytes=_int(raw.get("nbytes"), f"range of {name}: nbytes", 1),
            checksum=_int(raw.get("checksum", 0), f"range of {name}: checksum", 0, (1 << 64) - 1),
            run=_int(raw.get("run", 0), f"range of {name}: run"),
            stride=_int(raw.get("stride", 0), f"range of {name}: stride"),
        )
        if spec.run and (spec.nbytes % spec.run or spec.stride <= spec.run):
            raise WireError(f"range of {name} from rank {spec.rank}: a strided range needs nbytes a multiple "
                            f"of run and stride > run (nbytes={spec.nbytes}, run={spec.run}, stride={spec.stride})")
        if not spec.run and spec.stride:
            raise WireError(f"range of {name} from rank {spec.rank}: a contiguous range (run 0) has no stride")
        return spec


@dataclass(frozen=True)
class LocalShard:
    """One rank's block of a tensor: the global index of its first element per dim and its shape.

    ``replica``: this rank's index among the ranks that hold the same block (row-major over the mesh dims
    the tensor is replicated on); only replica 0 sends it."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    rank: int
    replica: int = 0

    @property
    def total_nbytes(self) -> int:
        return math.prod(self.global_shape) * DTYPE_SIZES[self.dtype]

    @property
    def local_nbytes(self) -> int:
        return math.prod(self.local_shape) * DTYPE_SIZES[self.dtype]


def _check_block(shard: LocalShard) -> None:
    g, o, n = shard.global_shape, shard.offset, shard.local_shape
    if shard.dtype not in DTYPE_SIZES:
        raise ShardError(f"tensor {shard.name}: dtype {shard.dtype!r} cannot travel", shard.name, (shard.rank,))
    if not len(g) == len(o) == len(n) or len(g) > MAX_NDIM:
        raise ShardError(f"tensor {shard.name}: rank {shard.rank}'s block has {len(o)} offsets and {len(n)} dims "
                         f"for a {len(g)}-dim tensor", shard.name, (shard.rank,))
    for d, (size, start, length) in enumerate(zip(g, o, n, strict=True)):
        if start < 0 or length < 0 or start + length > size:
            raise ShardError(f"tensor {shard.name}: rank {shard.rank}'s block [{start}, {start + length}) on dim {d} "
                             f"is outside the dim's {size}", shard.name, (shard.rank,))


def plan_ranges(shard: LocalShard) -> tuple[RangeSpec, ...]:
    """The ranges ``shard.rank`` sends of its block (checksum 0), in the order of the block's own
    row-major bytes: range ``i`` is bytes ``[i * r.nbytes, (i + 1) * r.nbytes)`` of the local shard (all
    ranges of one block have the same size). Empty when the block is empty or ``replica`` is not 0."""
    _check_block(shard)
    g, o, n = shard.global_shape, shard.offset, shard.local_shape
    width = DTYPE_SIZES[shard.dtype]
    if shard.replica or math.prod(n) == 0:
        return ()
    partial = [d for d in range(len(g)) if n[d] != g[d]]
    if not partial:
        return (RangeSpec(shard.name, shard.rank, 0, math.prod(g) * width),)
    k = partial[-1]  # the innermost dim the block does not span: a run is its slice of dims k..
    pitch = [math.prod(g[d + 1:]) for d in range(len(g))]  # elements per step of each dim
    run = n[k] * pitch[k]
    # dims m..k-1 enumerate the runs of one range (m: the innermost partial dim above k, or 0; the dims
    # between are full, so their steps continue one progression of stride pitch[k-1])
    above = [d for d in partial if d < k]
    m = above[-1] if above else 0
    count = math.prod(n[m:k])
    outer = [range(o[d], o[d] + n[d]) for d in range(m)]  # one range per index of the dims above m
    base = sum(o[d] * pitch[d] for d in range(m, k + 1))
    out = []
    for index in itertools.product(*outer):
        start = (base + sum(i * pitch[d] for d, i in enumerate(index))) * width
        if count == 1:
            out.append(RangeSpec(shard.name, shard.rank, start, run * width))
        else:
            out.append(RangeSpec(shard.name, shard.rank, start, run * count * width, 0, run * width, pitch[k - 1] * width))
    return tuple(out)


def shard_of_placements(name: str, dtype: str, global_shape: Sequence[int], mesh_shape: Sequence[int],
                        coordinate: Sequence[int], placements: Sequence[tuple[str, int] | tuple[str]],
                        rank: int) -> LocalShard:
    """The block of a DTensor at mesh ``coordinate`` with ``placements``, one per mesh dim: ``("shard", dim)``
    or ``("replicate",)``; ShardError for anything else (a partial sum is no rank's bytes: reduce first).

    Torch's chunk semantics: mesh dims apply in order; a dim of ``size`` split ``k`` ways gives each
    coordinate ``ceil(size / k)`` items from ``coordinate * ceil(size / k)``, so the last coordinates may get
    fewer or none (an empty shard's offset on that dim is the dim's size, as torch gives). ``replica`` is the row-major index of the coordinate over the replicating mesh dims."""
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ShardError(f"tensor {name}: mesh {list(mesh_shape)}, coordinate {list(coordinate)} and "
                         f"{len(placements)} placements do not match", name, (rank,))
    offset = [0] * len(global_shape)
    local = list(global_shape)
    replica = 0
    for size, coord, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if placement[0] == "replicate":
            replica = replica * size + coord
        elif placement[0] == "shard" and len(placement) == 2 and 0 <= placement[1] < len(global_shape):
            dim = placement[1]
            chunk = -(-local[dim] // size)
            start = min(coord * chunk, local[dim])
            length = max(0, min(chunk, local[dim] - start))
            offset[dim] = offset[dim] + start if length else global_shape[dim]  # torch's offset of an empty shard
            local[dim] = length
        else:
            raise ShardError(f"tensor {name}: placement {placement!r} on rank {rank} is not a byte range of the "
                             f"full tensor (only shard and replicate are)", name, (rank,))
    return LocalShard(name, dtype, tuple(global_shape), tuple(offset), tuple(local), rank, replica)


def check_cover(ranges: Sequence[RangeSpec], total_nbytes: int, ranks: Iterable[int], name: str = "") -> None:
    """The ranges (of one tensor) cover ``[0, total_nbytes)`` exactly once, each sent by a known rank.

    ShardError naming the tensor, the byte interval and the rank(s): an unknown rank, a range past the end,
    the first overlap (both ranks), the first gap (no rank). Time: the number of runs times log(ranges)."""
    known = frozenset(ranks)
    name = name or (ranges[0].name if ranges else "?")
    for r in ranges:
        if r.name != name:
            raise ShardError(f"tensor {name}: a range of tensor {r.name} from rank {r.rank} is checked with it", name, (r.rank,))
        if r.rank not in known:
            listed = f"{min(known)}..{max(known)}" if known else "none"
            raise ShardError(f"tensor {name}: {r.describe()} are sent by rank {r.rank}, not one of the ranks ({listed})",
                             name, (r.rank,))
        if r.end > total_nbytes:
            raise ShardError(f"tensor {name}: rank {r.rank}'s {r.describe()} run past the tensor's end "
                             f"({total_nbytes} bytes)", name, (r.rank,))
    cursor, last = 0, -1
    for start, end, rank in heapq.merge(*(_runs_of(r) for r in ranges)):
        if start < cursor:
            raise ShardError(f"tensor {name}: bytes [{start}, {min(end, cursor)}) are sent by both rank {min(last, rank)} "
                             f"and rank {max(last, rank)}", name, (last, rank))
        if start > cursor:
            raise ShardError(f"tensor {name}: bytes [{cursor}, {start}) are sent by no rank", name)
        cursor, last = end, rank
    if cursor < total_nbytes:
        raise ShardError(f"tensor {name}: bytes [{cursor}, {total_nbytes}) are sent by no rank", name)


def _runs_of(r: RangeSpec) -> Iterator[tuple[int, int, int]]:
    for start, end in r.runs():
        yield start, end, r.rank


@dataclass(frozen=True)
class TensorHeader:
    """A tensor as every rank must agree on it: name, dtype (as it travels) and global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, raw: Any) -> TensorHeader:
        if not isinstance(raw, list | tuple) or len(raw) != 3 or not isinstance(raw[0], str) or not isinstance(raw[2], list | tuple):
            raise WireError(f"a tensor header must be [name, dtype, shape], got {raw!r:.80}")
        if raw[1] not in DTYPE_SIZES or len(raw[2]) > MAX_NDIM:
            raise ManifestError(f"tensor {raw[0]}: dtype {raw[1]!r} or shape {raw[2]!r:.80} cannot travel")
        return cls(raw[0], raw[1], tuple(_int(d, f"tensor {raw[0]}: dim", 0, 1 << 40) for d in raw[2]))


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds and sends: the headers of the tensors it has a shard of, and its ranges."""

    rank: int
    tensors: tuple[TensorHeader, ...]
    ranges: tuple[RangeSpec, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "tensors": [t.to_wire() for t in self.tensors], "ranges": [r.to_wire() for r in self.ranges]}

    @classmethod
    def from_wire(cls, raw: Any) -> RankPlan:
        if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), list) or not isinstance(raw.get("ranges"), list):
            raise WireError("a rank's plan must be a map with lists tensors and ranges")
        return cls(_int(raw.get("rank"), "plan rank", 0, MAX_RANKS), tuple(TensorHeader.from_wire(t) for t in raw["tensors"]),
                   tuple(RangeSpec.from_wire(r) for r in raw["ranges"]))


def local_plan(rank: int, shards: Iterable[LocalShard]) -> RankPlan:
    """A rank's plan from its shards: every tensor's header and the ranges it sends (checksums 0)."""
    shards = list(shards)
    for s in shards:
        if s.rank != rank:
            raise ShardError(f"tensor {s.name}: a shard of rank {s.rank} in rank {rank}'s plan", s.name, (s.rank, rank))
    return RankPlan(rank, tuple(TensorHeader(s.name, s.dtype, s.global_shape) for s in shards),
                    tuple(r for s in shards for r in plan_ranges(s)))


@dataclass(frozen=True)
class ShardManifest:
    """One version's agreement: the tensors (layer order) and every rank's ranges (by tensor, then offset)."""

    world_size: int
    tensors: tuple[TensorHeader, ...]
    ranges: tuple[RangeSpec, ...]

    def ranges_of(self, rank: int) -> tuple[RangeSpec, ...]:
        return tuple(r for r in self.ranges if r.rank == rank)

    def to_wire(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "tensors": [t.to_wire() for t in self.tensors],
                "ranges": [r.to_wire() for r in self.ranges]}

    @classmethod
    def from_wire(cls, raw: Any) -> ShardManifest:
        """Decoded and validated as :func:`agree` validates (the receiver trusts no sender's cover)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), list) or not isinstance(raw.get("ranges"), list):
            raise WireError("a shard manifest must be a map with lists tensors and ranges")
        manifest = cls(_int(raw.get("world_size"), "world_size", 1, MAX_RANKS),
                       tuple(TensorHeader.from_wire(t) for t in raw["tensors"]),
                       tuple(RangeSpec.from_wire(r) for r in raw["ranges"]))
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Names unique; every range of a listed tensor; every tensor covered exactly once by ranks
        ``0..world_size-1`` (ShardError otherwise)."""
        headers: dict[str, TensorHeader] = {}
        for t in self.tensors:
            if t.name in headers:
                raise ShardError(f"tensor {t.name} is listed twice", t.name)
            headers[t.name] = t
        by_name: dict[str, list[RangeSpec]] = {name: [] for name in headers}
        for r in self.ranges:
            if r.name not in by_name:
                raise ShardError(f"rank {r.rank} sends {r.describe()} of tensor {r.name}, which no rank declared", r.name, (r.rank,))
            by_name[r.name].append(r)
        for name, ranges in by_name.items():
            check_cover(ranges, headers[name].nbytes, range(self.world_size), name)


def agree(plans: Sequence[RankPlan], world_size: int) -> ShardManifest:
    """Merge every rank's plan into the version's manifest and validate it: ranks ``0..world_size-1`` each
    exactly once, the same dtype and shape for a tensor on every rank that has it, each rank's ranges its
    own, every tensor covered exactly once (ShardError naming the rank(s) otherwise)."""
    seen: dict[int, RankPlan] = {}
    for p in plans:
        if not 0 <= p.rank < world_size:
            raise ShardError(f"a plan from rank {p.rank}, not one of the ranks 0..{world_size - 1}", ranks=(p.rank,))
        if p.rank in seen:
            raise ShardError(f"rank {p.rank} sent two plans", ranks=(p.rank,))
        seen[p.rank] = p
    missing = [r for r in range(world_size) if r not in seen]
    if missing:
        raise ShardError(f"no plan from rank(s) {', '.join(map(str, missing))} of {world_size}", ranks=missing)
    headers: dict[str, tuple[TensorHeader, int]] = {}
    for p in sorted(seen.values(), key=lambda p: p.rank):
        for t in p.tensors:
            first = headers.setdefault(t.name, (t, p.rank))
            if first[0] != t:
                raise ShardError(f"tensor {t.name}: rank {first[1]} has {first[0].dtype} {list(first[0].shape)}, rank "
                                 f"{p.rank} has {t.dtype} {list(t.shape)}", t.name, (first[1], p.rank))
        for r in p.ranges:
            if r.rank != p.rank:
                raise ShardError(f"tensor {r.name}: rank {p.rank}'s plan holds {r.describe()} for rank {r.rank}",
                                 r.name, (p.rank, r.rank))
    names = list(headers)
    ordered = [headers[names[i]][0] for i in order_by_layer(names)]
    position = {t.name: i for i, t in enumerate(ordered)}
    ranges = sorted((r for p in seen.values() for r in p.ranges),
                    key=lambda r: (position.get(r.name, len(position)), r.offset, r.rank))
    manifest = ShardManifest(world_size, tuple(ordered), tuple(ranges))
    manifest.validate()
    return manifest


def check_matches(shards: ShardManifest, tensors: Sequence[TensorSpec]) -> None:
    """A shard manifest describes exactly the update's tensors (same names, dtypes and shapes): ShardError
    naming the first tensor that differs."""
    specs = {t.name: t for t in tensors}
    headers = {t.name: t for t in shards.tensors}
    for name in sorted(set(specs) ^ set(headers)):
        where = "the update" if name in specs else "the shard manifest"
        raise ShardError(f"tensor {name} is listed only in {where}", name)
    for name, header in headers.items():
        spec = specs[name]
        if (spec.dtype, spec.shape) != (header.dtype, header.shape):
            raise ShardError(f"tensor {name}: the update says {spec.dtype} {list(spec.shape)}, the shard manifest "
                             f"{header.dtype} {list(header.shape)}", name)


def layout(shards: ShardManifest, bucket_bytes: int) -> tuple[tuple[TensorSpec, ...], tuple[int, ...]]:
    """The full-tensor bucket layout of a sharded update (what a single-process publisher would send): each
    tensor's bucket and offset, in the shard manifest's (layer) order, and the bucket sizes. Every rank
    computes the same from the agreed manifest; a range lands at its tensor's offset plus its own."""
    placements, sizes = plan_buckets([(t.name, t.nbytes) for t in shards.tensors], bucket_bytes)
    specs = tuple(TensorSpec(t.name, t.dtype, t.shape, p.bucket, p.offset, p.nbytes)
                  for t, p in zip(shards.tensors, placements, strict=True))
    return specs, tuple(sizes)


def bucket_ranges(shards: ShardManifest, tensors: Sequence[TensorSpec], n_buckets: int) -> list[list[RangeSpec]]:
    """The ranges of each bucket (the bucket of its tensor), in the manifest's range order: the order of a
    bucket header's checksums."""
    bucket_of = {t.name: t.bucket for t in tensors}
    out: list[list[RangeSpec]] = [[] for _ in range(n_buckets)]
    for r in shards.ranges:
        out[bucket_of[r.name]].append(r)
    return out


def range_checksum(view: memoryview, base: int, r: RangeSpec, algorithm: str) -> int:
    """The checksum (``algorithm``) of range ``r``'s bytes as sent (its runs concatenated, in order), read
    from ``view`` where the range's tensor starts at byte ``base``."""
    from bridge.checksums import function, running

    if not r.run:
        return int(function(algorithm)(view[base + r.offset : base + r.offset + r.nbytes]))
    hasher = running(algorithm)()
    for start, end in r.runs():
        hasher.update(view[base + start : base + end])
    return int(hasher.intdigest())
