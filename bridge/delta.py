"""Delta codec: one tensor of version N+1 as a patch against the version N an engine serves.

Pure: no transport, no engine. ``encode`` compares two same-shape, same-dtype CPU tensors bit for bit and
chooses per tensor the smallest of three encodings (docs/delta.md):

``sparse``  the positions whose bit patterns differ (gaps between them, ``uint32``, or ``uint64`` when the
            tensor has more than 2**32 elements) and, at each, the XOR of base and new bits;
``xor``     the XOR of the two bit patterns over the whole tensor (mostly zero bytes);
``dense``   the new bit patterns themselves (no base needed, but the base is still checked).

Sparse and xor payloads store their multi-byte streams as byte planes (byte 0 of every element, then
byte 1, ...), which puts the bytes that rarely change next to each other; each payload is compressed
with zstd (level 1) when that makes it smaller (``codec`` "zstd", else "none"), unless the caller asks for
none (``level=None``: a publisher whose engines are all on its host, ``sync.delta_compress``). A dense payload is the
tensor's bytes as they are, or, compressed, its byte planes. Everything works on bit patterns, never on
float values, so it is exact at the bit level: NaN payloads, -0.0 and 0.0, subnormals round-trip.

The chain is explicit: a ``DeltaSpec`` names its base version and the checksum of the base's bytes, and
the checksum of the resulting full tensor. ``apply`` refuses a base whose checksum differs
(:class:`WrongBase`) before writing anything, and a patch that does not decode or whose result does not
hash to the declared checksum (:class:`CorruptPatch`). Checksums are those of bridge/checksums.py, over the
tensor's bytes in its wire dtype, so a delta's result checksum is the one a dense update of the same
tensor carries.

In place, for the two sides' hot paths: ``changed_positions`` finds the changed elements and the new
checksum in one read of base and new (what ``encode_bytes`` then takes as ``positions``), and
``patch_in_place`` turns a receiver's own base into the result, recording what it overwrote
(``undo_patches`` puts it back) and putting the base back itself when the result's checksum is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from bridge import checksums
from bridge.errors import CorruptPatch, ManifestError, WrongBase
from bridge.wire import _NAME_RE, DTYPE_SIZES, MAX_NDIM, _int, _require, _str

if TYPE_CHECKING:
    import numpy as np
    import torch

Encoding = Literal["sparse", "xor", "dense"]
Codec = Literal["zstd", "none"]
ENCODINGS: tuple[Encoding, ...] = ("sparse", "xor", "dense")
CODECS: tuple[Codec, ...] = ("zstd", "none")
ZSTD_LEVEL = 1  # measured fastest for its ratio on weights (docs/delta.md): zlib 1 is 10-20x slower
# ``encode`` makes a sparse patch up to this fraction of changed elements and an XOR patch beyond it (one
# of the two, not both: below it sparse was smaller, or larger by under 0.1% of dense, in every case
# measured (bf16, fp16, fp32; steps of 1e-2 and 1e-4: tests/test_delta.py); above it the two are close)
SPARSE_MAX_CHANGED = 0.5
# ``encode`` tries compressing the dense bytes only when no delta candidate is below this fraction of the
# dense size: weights compress to 65-80% at best, so a smaller delta wins without spending the pass
DENSE_TRY_ABOVE = 0.5


def index_width(numel: int) -> int:
    """Bytes per position gap of a sparse patch of a tensor of ``numel`` elements."""
    return 4 if numel <= 1 << 32 else 8


@dataclass(frozen=True)
class DeltaSpec:
    """One tensor's delta as the manifest carries it (``to_wire``: a map of plain scalars for msgpack).

    ``nbytes`` is the size of the payload on the wire, ``dense_nbytes`` of the full tensor
    (``numel * element size``). ``changed`` counts the elements whose bit patterns differ between base and
    result (what a sparse payload holds; telemetry for the others). ``checksum`` names the algorithm of
    ``base_checksum`` (over the base's bytes) and ``result_checksum`` (over the resulting tensor's bytes).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    codec: Codec
    base_version: int
    base_checksum: int
    result_checksum: int
    checksum: str
    nbytes: int
    dense_nbytes: int
    changed: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def raw_nbytes(self) -> int:
        """Size of the payload before compression (what ``codec`` "none" sends)."""
        if self.encoding == "sparse":
            return self.changed * (index_width(self.numel) + self.itemsize)
        return self.dense_nbytes

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding,
            "codec": self.codec, "base_version": self.base_version, "base_checksum": self.base_checksum,
            "result_checksum": self.result_checksum, "checksum": self.checksum, "nbytes": self.nbytes,
            "dense_nbytes": self.dense_nbytes, "changed": self.changed,
        }

    @classmethod
    def from_wire(cls, raw: Any) -> DeltaSpec:
        """Validate a received map: every field typed and in range, sizes consistent. WireError or
        ManifestError naming what is wrong."""
        _require(isinstance(raw, dict), f"delta entry must be a map, got {type(raw).__name__}")
        name = _str(raw.get("name"), "delta tensor name")
        _require(bool(_NAME_RE.fullmatch(name)) and ".." not in name, f"delta tensor name {name!r} is not a valid parameter path", ManifestError)
        dtype = _str(raw.get("dtype"), f"delta {name}: dtype", 32)
        _require(dtype in DTYPE_SIZES, f"delta {name}: unknown dtype {dtype!r}", ManifestError)
        shape_raw = raw.get("shape")
        _require(isinstance(shape_raw, list | tuple) and len(shape_raw) <= MAX_NDIM, f"delta {name}: shape must be a list of at most {MAX_NDIM} dims", ManifestError)
        shape = tuple(_int(d, f"delta {name}: dim", 0, 1 << 40) for d in shape_raw)  # type: ignore[union-attr]
        encoding = raw.get("encoding")
        _require(encoding in ENCODINGS, f"delta {name}: unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
        codec = raw.get("codec")
        _require(codec in CODECS, f"delta {name}: unknown codec {codec!r} (known: {', '.join(CODECS)})")
        algorithm = _str(raw.get("checksum"), f"delta {name}: checksum", 32)
        _require(algorithm in checksums.KNOWN, f"delta {name}: unknown checksum algorithm {algorithm!r} (known: {', '.join(checksums.KNOWN)})")
        spec = cls(
            name=name, dtype=dtype, shape=shape, encoding=encoding, codec=codec, checksum=algorithm,  # type: ignore[arg-type]
            base_version=_int(raw.get("base_version"), f"delta {name}: base_version"),
            base_checksum=_int(raw.get("base_checksum"), f"delta {name}: base_checksum", 0, 0xFFFFFFFFFFFFFFFF),
            result_checksum=_int(raw.get("result_checksum"), f"delta {name}: result_checksum", 0, 0xFFFFFFFFFFFFFFFF),
            nbytes=_int(raw.get("nbytes"), f"delta {name}: nbytes"),
            dense_nbytes=_int(raw.get("dense_nbytes"), f"delta {name}: dense_nbytes"),
            changed=_int(raw.get("changed"), f"delta {name}: changed"),
        )
        spec.check()
        return spec

    def check(self) -> None:
        """Sizes consistent with dtype, shape, encoding and codec (ManifestError otherwise)."""
        name, numel = self.name, self.numel
        expected = numel * self.itemsize
        _require(self.dense_nbytes == expected, f"delta {name}: dense_nbytes={self.dense_nbytes} but shape {list(self.shape)} of {self.dtype} needs {expected}", ManifestError)
        _require(self.changed <= numel, f"delta {name}: changed={self.changed} exceeds the {numel} elements", ManifestError)
        if self.codec == "none":
            _require(self.nbytes == self.raw_nbytes, f"delta {name}: an uncompressed {self.encoding} payload is {self.raw_nbytes} bytes, not {self.nbytes}", ManifestError)


@dataclass(frozen=True)
class DeltaTensor:
    """A ``DeltaSpec`` and its payload (``len(payload) == spec.nbytes``)."""

    spec: DeltaSpec
    payload: bytes


# ---- bytes and bit patterns ---------------------------------------------------------------------


def _uint(width: int) -> str:
    return f"<u{width}"


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 array (a view when it is contiguous, else a copy)."""
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"delta: tensors must be on the CPU, got {tensor.device}")
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"delta: dtype {name} is not a wire dtype (known: {', '.join(DTYPE_SIZES)})")
    return name


def _planes(data: np.ndarray, width: int) -> np.ndarray:
    """Byte planes of ``width``-byte elements: byte 0 of every element, then byte 1, ... (a flat uint8 array)."""
    flat = data.reshape(-1).view("u1")
    if width == 1:
        return flat
    return flat.reshape(-1, width).T.copy().reshape(-1)


def _unplanes(planes: np.ndarray, width: int, out: np.ndarray) -> None:
    """Inverse of ``_planes`` into the flat uint8 array ``out``."""
    if width == 1:
        out[:] = planes
    else:
        out.reshape(-1, width)[:] = planes.reshape(width, -1).T


def _compress(raw: np.ndarray, level: int | None) -> bytes | None:
    """``raw`` compressed with zstd at ``level``, or None when that does not make it smaller or ``level`` is None
    (not compressed)."""
    if raw.nbytes == 0 or level is None:
        return None
    import zstandard

    packed = zstandard.ZstdCompressor(level=level).compress(raw.data)
    return packed if len(packed) < raw.nbytes else None


def _candidate(encoding: Encoding, raw: np.ndarray, level: int | None) -> tuple[Encoding, Codec, bytes | None]:
    packed = _compress(raw, level)
    return (encoding, "none", raw.tobytes()) if packed is None else (encoding, "zstd", packed)


def _decompress(spec: DeltaSpec, payload: bytes | memoryview) -> np.ndarray:
    """The raw payload as a uint8 array of exactly ``spec.raw_nbytes``; CorruptPatch if it does not decode."""
    import numpy as np

    expected = spec.raw_nbytes
    if len(payload) != spec.nbytes:
        raise CorruptPatch(f"tensor {spec.name}: corrupt patch: {len(payload)} payload bytes, the delta declares {spec.nbytes}")
    if spec.codec == "none":
        return np.frombuffer(payload, dtype="u1")
    import zstandard

    try:
        # decompress() trusts the frame's declared size over max_output_size: check it first (bounded memory)
        declared = zstandard.frame_content_size(payload)
        if declared != expected:
            raise CorruptPatch(f"tensor {spec.name}: corrupt patch: the zstd frame declares {declared} bytes, the {spec.encoding} payload needs {expected}")
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CorruptPatch(f"tensor {spec.name}: corrupt patch: zstd: {exc}") from exc
    if len(raw) != expected:
        raise CorruptPatch(f"tensor {spec.name}: corrupt patch: decompressed to {len(raw)} bytes, expected {expected}")
    return np.frombuffer(raw, dtype="u1")


# ---- encode ------------------------------------------------------------------------------------


def encode(base: torch.Tensor, new: torch.Tensor, *, name: str, base_version: int, checksum: str = checksums.DEFAULT,
           encodings: Sequence[Encoding] = ENCODINGS, level: int | None = ZSTD_LEVEL, base_checksum: int | None = None) -> DeltaTensor:
    """The delta turning ``base`` into ``new`` (same shape and dtype, CPU), in the smallest encoding tried.

    ``encodings`` restricts the candidates (at least one); ``level`` is zstd's, None for payloads left
    uncompressed (codec "none"). Two are tried: a patch, sparse when at most
    ``SPARSE_MAX_CHANGED`` of the elements changed and xor otherwise (the other one when only it is
    allowed), and dense, compressed only when the patch is not below ``DENSE_TRY_ABOVE`` of the dense
    size; the fewer payload bytes win (ties: the patch). ``base_checksum`` may pass the base's checksum when the caller
    already has it (the publisher sent it with version ``base_version``); it is trusted, not recomputed.
    Raises ValueError on tensors that cannot be compared (shape, dtype, device) or unknown encodings.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(f"delta {name}: base {tuple(base.shape)} {base.dtype} and new {tuple(new.shape)} {new.dtype} differ in shape or dtype")
    unknown = [e for e in encodings if e not in ENCODINGS]
    if unknown or not encodings:
        raise ValueError(f"delta {name}: encodings must be a non-empty subset of {ENCODINGS}, got {list(encodings)}")
    dtype = dtype_name(new)
    return encode_bytes(tensor_bytes(base), tensor_bytes(new), name=name, dtype=dtype, shape=tuple(new.shape),
                        base_version=base_version, checksum=checksum, encodings=encodings, level=level,
                        base_checksum=base_checksum)


def encode_bytes(base: np.ndarray, new: np.ndarray, *, name: str, dtype: str, shape: tuple[int, ...], base_version: int,
                 checksum: str = checksums.DEFAULT, encodings: Sequence[Encoding] = ENCODINGS, level: int | None = ZSTD_LEVEL,
                 base_checksum: int | None = None, result_checksum: int | None = None,
                 positions: np.ndarray | None = None, values: np.ndarray | None = None) -> DeltaTensor:
    """``encode`` on the raw little-endian bytes (flat uint8 arrays) of a ``dtype`` tensor of ``shape``;
    ``result_checksum`` may pass the checksum of ``new`` when the caller has it (trusted, not recomputed), and
    ``positions`` and ``values`` the elements whose bit patterns differ and the XOR of base and new at each
    (``changed_positions``: trusted, not recomputed; the same payload results). Given those, ``base`` is
    not read (only its checksum is needed, as ``base_checksum``), so it may already hold ``new``."""
    import numpy as np

    width = DTYPE_SIZES[dtype]
    numel = math.prod(shape)
    if base.nbytes != numel * width or new.nbytes != numel * width:
        raise ValueError(f"delta {name}: {base.nbytes} and {new.nbytes} bytes for a {list(shape)} {dtype} tensor of {numel * width}")
    fn = checksums.function(checksum)
    old_bits = base.view(_uint(width))
    new_bits = new.view(_uint(width))
    diff: np.ndarray | None = None
    if positions is None or values is None:
        diff = np.bitwise_xor(old_bits, new_bits)
        positions = np.flatnonzero(diff != 0)  # through a bool mask: 4x faster than on the integers
    changed = int(positions.size)

    candidates: list[tuple[Encoding, Codec, bytes | None]] = []  # None: the dense bytes, copied only if chosen
    patch = "sparse" if changed <= SPARSE_MAX_CHANGED * numel else "xor"
    if patch not in encodings:
        patch = "xor" if patch == "sparse" else "sparse"
    if patch == "sparse" and "sparse" in encodings:
        iw = index_width(numel)
        gaps = np.empty(changed, dtype=_uint(iw))
        if changed:
            gaps[0] = positions[0]
            np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
        if diff is not None:
            values = diff[positions]
        assert values is not None
        raw = np.concatenate([_planes(gaps, iw), _planes(values, width)])
        candidates.append(_candidate("sparse", raw, level))
    elif patch == "xor" and "xor" in encodings:
        if diff is None:  # from the changed positions' values: the base may hold the new bytes already
            diff = np.zeros(numel, dtype=_uint(width))
            diff[positions] = values
        candidates.append(_candidate("xor", _planes(diff, width), level))
    if "dense" in encodings:
        best = min((_size(c[2], numel * width) for c in candidates), default=numel * width)
        packed = (_compress(_planes(new_bits, width), level)
                  if level is not None and best >= DENSE_TRY_ABOVE * numel * width else None)
        candidates.append(("dense", "none", None) if packed is None else ("dense", "zstd", packed))
    encoding, codec, chosen = min(candidates, key=lambda c: _size(c[2], numel * width))
    payload = new.tobytes() if chosen is None else chosen
    spec = DeltaSpec(
        name=name, dtype=dtype, shape=tuple(shape), encoding=encoding, codec=codec, base_version=base_version,
        base_checksum=fn(base) if base_checksum is None else base_checksum, result_checksum=fn(new) if result_checksum is None else result_checksum, checksum=checksum,
        nbytes=len(payload), dense_nbytes=numel * width, changed=changed,
    )
    return DeltaTensor(spec, payload)


COMPARE_CHUNK_BYTES = 1 << 20  # compared (and summed) while in cache


def changed_positions(base: np.ndarray, new: np.ndarray, width: int, checksum: str | None = None,
                      patch: bool = False) -> tuple[np.ndarray, np.ndarray, int | None]:
    """The positions (int64, increasing) of the ``width``-byte elements whose bit patterns differ between
    ``base`` and ``new`` (flat uint8 arrays of one size), the XOR of base and new at each, and, with
    ``checksum``, that algorithm's checksum of ``new``: one read of each, chunk by chunk, on the calling thread
    (the values gathered and the checksum fed while the chunk is in cache, not by random access or a second
    pass afterwards). With ``patch`` the changed elements of ``base`` are overwritten with ``new``'s in the
    same pass, so ``base`` ends as ``new``. One thread: the compare runs while the engines load the buckets
    before it (a delta is loaded as it arrives), on hosts where trainer and engine may share cores. The
    compare is ``bridge.delta_kernels``' compiled loop where numba is available (one pass over 64-bit words),
    else numpy's (the same result)."""
    if base.nbytes != new.nbytes or base.nbytes % width:
        raise ValueError(f"changed_positions: {base.nbytes} and {new.nbytes} bytes of {width}-byte elements")
    kernels = compiled()
    if kernels is None or width not in (1, 2, 4, 8) or not base.flags.writeable:  # numba types the loop's write to base
        return _changed_positions_numpy(base, new, width, checksum, patch)
    return _changed_positions_compiled(kernels, base, new, width, checksum, patch)


def _changed_positions_numpy(base: np.ndarray, new: np.ndarray, width: int, checksum: str | None,
                             patch: bool) -> tuple[np.ndarray, np.ndarray, int | None]:
    import numpy as np

    old_bits, new_bits = base.view(_uint(width)), new.view(_uint(width))
    numel, step = int(old_bits.size), max(COMPARE_CHUNK_BYTES // width, 1)
    digest = checksums.running(checksum)() if checksum is not None else None
    found, xors = [], []
    for start in range(0, numel, step):
        end = min(start + step, numel)
        a, b = old_bits[start:end], new_bits[start:end]
        if digest is not None:
            digest.update(b)
        hits = np.flatnonzero(a != b)
        if hits.size:
            fresh = b[hits]
            xors.append(np.bitwise_xor(a[hits], fresh))
            if patch:
                a[hits] = fresh
            found.append(hits + start)
    positions = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    values = np.concatenate(xors) if xors else np.zeros(0, dtype=_uint(width))
    return positions.astype(np.int64, copy=False), values, None if digest is None else int(digest.intdigest())


def _changed_positions_compiled(kernels: Any, base: np.ndarray, new: np.ndarray, width: int, checksum: str | None,
                                patch: bool) -> tuple[np.ndarray, np.ndarray, int | None]:
    """``changed_positions`` over 64-bit words with ``delta_kernels.compare_words``; the bytes after the last
    whole word (under 8) by numpy. Chunks of ``COMPARE_CHUNK_BYTES`` (a multiple of 8)."""
    import numpy as np

    nbytes, lanes = int(base.nbytes), 8 // width
    words = nbytes // 8
    old64, new64 = base[: words * 8].view("<u8"), new[: words * 8].view("<u8")
    chunk = min(COMPARE_CHUNK_BYTES // 8, max(words, 1))  # words; the scratch no larger than the tensor
    scratch_pos = np.empty(chunk * lanes, dtype=np.int64)
    scratch_xor = np.empty(chunk * lanes, dtype=np.uint64)
    digest = checksums.running(checksum)() if checksum is not None else None
    found, xors = [], []
    for start in range(0, words, chunk):
        end = min(start + chunk, words)
        k = kernels.compare_words(old64[start:end], new64[start:end], lanes, 8 * width, patch, scratch_pos, scratch_xor)
        if digest is not None:
            digest.update(new[start * 8:end * 8])
        if k:
            found.append(scratch_pos[:k] + start * lanes)
            xors.append(scratch_xor[:k].astype(_uint(width)))
    if words * 8 < nbytes:  # the tail: fewer than 8 bytes
        tail_pos, tail_xor, _ = _changed_positions_numpy(base[words * 8:], new[words * 8:], width, None, patch)
        if digest is not None:
            digest.update(new[words * 8:])
        if tail_pos.size:
            found.append(tail_pos + words * lanes)
            xors.append(tail_xor)
    positions = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    values = np.concatenate(xors) if xors else np.zeros(0, dtype=_uint(width))
    return positions, values, None if digest is None else int(digest.intdigest())


_COMPILED: Any = None  # bridge.delta_kernels once loaded, False where it cannot be
_WARMING: list[Any] = []  # the thread ``warm_compiled`` started, once per process


def compiled() -> Any:
    """``bridge.delta_kernels`` (numba's compiled loops), or None where numba does not import or the host is
    big-endian: callers then take the numpy form, which gives the same results."""
    global _COMPILED
    if _COMPILED is None:
        import sys

        try:
            if sys.byteorder != "little":
                raise ImportError("big-endian host")
            from bridge import delta_kernels
        except (ImportError, RuntimeError, OSError):  # no numba; numba finding no writable cache location
            _COMPILED = False
        else:
            _COMPILED = delta_kernels
    return _COMPILED or None


def warm_compiled() -> Any:
    """Load ``bridge.delta_kernels`` and each of its loops for every element width on a daemon thread, once per
    process, so that the first delta does not wait for numba's import and the loops' load from its cache
    (0.7 s here; 2.8 s when they compile, the first time a checkout runs them). A delta publisher calls it
    when it publishes (its first version goes dense), a base store when it first holds a version (after the
    engine started: no fork follows that could inherit the thread's import locks). The process waits for the
    thread at exit (at most 10 s), not to end inside numba. Returns the thread (the first one, on later calls)."""
    import atexit
    import threading

    if not _WARMING:
        thread = threading.Thread(target=_warm, name="wb-delta-warm", daemon=True)
        _WARMING.append(thread)
        thread.start()
        atexit.register(thread.join, 10.0)
    return _WARMING[0]


def _warm() -> None:
    import numpy as np

    kernels = compiled()
    if kernels is None:
        return
    for width in (1, 2, 4, 8):
        a, b = np.zeros(16, np.uint8), np.ones(16, np.uint8)
        _changed_positions_compiled(kernels, a, b, width, None, True)
        positions, values = np.zeros(1, np.int64), np.ones(1, _uint(width))
        kernels.patch_sparse(a.view(_uint(width)), positions, values, np.empty_like(values), 0, 1)
        kernels.decode_sparse(np.zeros(4 + width, np.uint8), 1, 4, width, 2, positions, values)


def _size(payload: bytes | None, dense_nbytes: int) -> int:
    return dense_nbytes if payload is None else len(payload)


# ---- apply -------------------------------------------------------------------------------------


def check_base(base: np.ndarray, spec: DeltaSpec) -> None:
    """Refuse a base that is not the one ``spec`` was made against: ManifestError when its size differs,
    WrongBase (naming the tensor and both checksums) when its checksum differs. Reads ``base`` (its
    bytes, a flat uint8 array) only; a receiver may call it as soon as the manifest arrives, before any
    payload."""
    nbytes = base.nbytes
    if nbytes != spec.dense_nbytes:
        raise ManifestError(f"tensor {spec.name}: the base here is {nbytes} bytes, the delta's {list(spec.shape)} {spec.dtype} is {spec.dense_nbytes}")
    actual = checksums.function(spec.checksum)(base)
    if actual != spec.base_checksum:
        raise WrongBase(
            f"tensor {spec.name}: wrong base: the delta applies to version {spec.base_version} whose {spec.checksum} "
            f"is {spec.base_checksum:#x}, the base here has {actual:#x}"
        )


def apply_bytes(base: np.ndarray, delta: DeltaTensor, out: np.ndarray) -> None:
    """Write the result of ``delta`` on ``base`` into ``out`` (flat uint8 arrays of ``dense_nbytes``) and
    verify it.

    Contract, in order:
      1. ``check_base``: ManifestError or WrongBase, ``out`` untouched.
      2. the payload is decoded and checked (sizes, zstd frame, positions in range and increasing):
         CorruptPatch, ``out`` untouched.
      3. the result is written into ``out`` and its checksum compared with ``result_checksum``:
         CorruptPatch, and ``out`` holds bytes that must not be used (the caller discards it: staged
         updates apply into staging, which a failed update drops).
    ``base`` is only read; ``out`` must not overlap it (ValueError).
    """
    import numpy as np

    spec = delta.spec
    if out.nbytes != spec.dense_nbytes:
        raise ValueError(f"delta {spec.name}: out is {out.nbytes} bytes, the result is {spec.dense_nbytes}")
    if np.may_share_memory(base, out):
        raise ValueError(f"delta {spec.name}: out overlaps base; apply never writes into its base")
    check_base(base, spec)
    width, numel = spec.itemsize, spec.numel
    raw = _decompress(spec, delta.payload)
    out_bits = out.view(_uint(width))
    base_bits = base.view(_uint(width))
    if spec.encoding == "sparse":
        positions, values = _sparse_decode(spec, raw)
        out[:] = base
        out_bits[positions] ^= values
    elif spec.encoding == "xor":
        diff = np.empty(numel, dtype=_uint(width))
        _unplanes(raw, width, diff.view("u1"))
        np.bitwise_xor(base_bits, diff, out=out_bits)
    elif spec.codec == "none":
        out[:] = raw
    else:
        _unplanes(raw, width, out)
    actual = checksums.function(spec.checksum)(out)
    if actual != spec.result_checksum:
        raise CorruptPatch(
            f"tensor {spec.name}: corrupt patch: the result's {spec.checksum} is {actual:#x}, the delta declares "
            f"{spec.result_checksum:#x} (version {spec.base_version} + {spec.encoding} patch)"
        )


def patch_in_place(data: np.ndarray, delta: DeltaTensor, undo: list[Any],
                   check_base_bytes: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """Turn ``data`` (the base's bytes, a flat uint8 array) into the result of ``delta`` **in place**, recording
    in ``undo`` what ``undo_patches`` needs to put the base back bit for bit; returns the positions written
    (int64 elements) and the values written there (unsigned integers of the element's width), or None when
    the whole tensor was (xor, dense).

    Contract, in order:
      1. the base: its size (ManifestError), then, with ``check_base_bytes``, its checksum (WrongBase); a
         caller whose base's checksum is recorded and was checked against the delta's (``BaseStore.check``)
         may skip the rehash. ``data`` untouched.
      2. the payload decoded and checked as ``apply_bytes`` does (CorruptPatch), ``data`` untouched.
      3. the result written into ``data`` (the base's old values at the written positions, or a copy of the
         whole base, appended to ``undo`` first) and its checksum compared with ``result_checksum``: on a
         mismatch the base is put back (and its record taken off ``undo``) and CorruptPatch raised, so a
         refused patch leaves ``data`` as it was.
    The checksum checked is the one of the resulting full tensor, as for ``apply_bytes``."""
    import numpy as np

    spec = delta.spec
    if data.nbytes != spec.dense_nbytes:
        raise ManifestError(f"tensor {spec.name}: the base here is {data.nbytes} bytes, the delta's {list(spec.shape)} {spec.dtype} is {spec.dense_nbytes}")
    if check_base_bytes:
        check_base(data, spec)
    width, numel = spec.itemsize, spec.numel
    raw = _decompress(spec, delta.payload)
    bits = data.view(_uint(width))
    written: tuple[np.ndarray, np.ndarray] | None = None
    actual: int | None = None
    if spec.encoding == "sparse":
        positions, values = _sparse_decode(spec, raw)
        # chunk by chunk: a chunk's old values gathered, its new ones written and its bytes summed while in cache
        old = np.empty_like(values)
        undo.append((bits, positions, old))
        hasher = checksums.running(spec.checksum)()
        step = max(COMPARE_CHUNK_BYTES // width, 1)
        cuts = np.searchsorted(positions, np.arange(step, numel, step, dtype=np.int64)).tolist() + [positions.size]
        kernels = compiled()
        lo = 0
        for chunk, hi in enumerate(cuts):
            if hi > lo and kernels is not None:
                kernels.patch_sparse(bits, positions, values, old, lo, hi)
            elif hi > lo:
                where = positions[lo:hi]
                old[lo:hi] = bits[where]
                np.bitwise_xor(old[lo:hi], values[lo:hi], out=values[lo:hi])
                bits[where] = values[lo:hi]
            hasher.update(data[chunk * step * width:(chunk + 1) * step * width])
            lo = hi
        actual = int(hasher.intdigest())
        written = positions, values
    else:
        diff = None
        if spec.encoding == "xor":
            diff = np.empty(numel, dtype=_uint(width))
            _unplanes(raw, width, diff.view("u1"))
        undo.append((data, None, data.copy()))
        if diff is not None:
            np.bitwise_xor(bits, diff, out=bits)
        elif spec.codec == "none":
            data[:] = raw
        else:
            _unplanes(raw, width, data)
    if actual is None:
        actual = checksums.function(spec.checksum)(data)
    if actual != spec.result_checksum:
        undo_patches([undo.pop()])
        raise CorruptPatch(
            f"tensor {spec.name}: corrupt patch: the result's {spec.checksum} is {actual:#x}, the delta declares "
            f"{spec.result_checksum:#x} (version {spec.base_version} + {spec.encoding} patch); the base is kept"
        )
    return written


def undo_patches(undo: list[Any]) -> None:
    """Put back, latest first, what ``patch_in_place`` (or a caller, with the same records) overwrote."""
    for target, where, old in reversed(undo):
        if where is None:
            target[:] = old
        else:
            target[where] = old


def _sparse_decode(spec: DeltaSpec, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, strictly increasing, in range) and XOR values of a sparse payload; CorruptPatch
    when the positions are not. ``delta_kernels.decode_sparse`` where numba is available, else numpy."""
    import numpy as np

    k, width, numel = spec.changed, spec.itemsize, spec.numel
    iw = index_width(numel)
    kernels = compiled()
    if kernels is not None:
        positions = np.empty(k, dtype=np.int64)
        values = np.empty(k, dtype=_uint(width))
        status = kernels.decode_sparse(raw, k, iw, width, numel, positions, values)
    else:
        positions, values, status = _sparse_decode_numpy(raw, k, iw, width, numel)
    if status == 1:
        raise CorruptPatch(f"tensor {spec.name}: corrupt patch: sparse positions are not strictly increasing inside {numel} elements")
    if status == 2:
        raise CorruptPatch(f"tensor {spec.name}: corrupt patch: sparse positions run past {numel} elements")
    return positions, values


def _sparse_decode_numpy(raw: np.ndarray, k: int, iw: int, width: int, numel: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``_sparse_decode`` by numpy: positions, values and the status of ``delta_kernels.decode_sparse``."""
    import numpy as np

    gaps = np.empty(k, dtype=_uint(iw))
    _unplanes(raw[: k * iw], iw, gaps.view("u1"))
    values = np.empty(k, dtype=_uint(width))
    _unplanes(raw[k * iw :], width, values.view("u1"))
    if k == 0:
        return np.zeros(0, dtype=np.int64), values, 0
    # every gap below numel, so a cumulative sum that wrapped would decrease: increasing and the last in
    # range means every position is distinct and inside the tensor
    if int(gaps.max()) >= numel or (k > 1 and int(gaps[1:].min()) == 0):
        return gaps.astype(np.int64), values, 1
    positions = np.cumsum(gaps, dtype=np.uint64)
    if int(positions[-1]) >= numel or (k > 1 and not bool(np.all(positions[1:] > positions[:-1]))):
        return positions.astype(np.int64), values, 2
    return positions.astype(np.int64), values, 0


def apply(base: torch.Tensor, delta: DeltaTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``delta`` makes of ``base`` (CPU, the delta's dtype and shape), verified as a whole.

    With ``out`` (a contiguous CPU tensor of the delta's dtype and shape, e.g. a view into staging) the
    result is written there and ``out`` returned; else a new tensor. Errors and what they leave in ``out``:
    see ``apply_bytes`` (a wrong base or an undecodable patch leaves it untouched, a result that fails its
    checksum leaves it unusable). ``base`` is never written.
    """
    import torch

    spec = delta.spec
    if dtype_name(base) != spec.dtype or tuple(base.shape) != spec.shape:
        raise ManifestError(f"tensor {spec.name}: the base here is {list(base.shape)} {dtype_name(base)}, the delta is for {list(spec.shape)} {spec.dtype}")
    if out is None:
        out = torch.empty(spec.shape, dtype=base.dtype)
    elif out.dtype != base.dtype or tuple(out.shape) != spec.shape or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"delta {spec.name}: out must be a contiguous CPU {spec.dtype} tensor of shape {list(spec.shape)}")
    apply_bytes(tensor_bytes(base), delta, out.reshape(-1).view(torch.uint8).numpy())
    return out


# ---- planning ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WireChoice:
    """What one tensor sends: its delta payload (``send`` "delta") or its dense bytes ("dense")."""

    name: str
    send: Literal["delta", "dense"]
    nbytes: int
    dense_nbytes: int


@dataclass(frozen=True)
class WirePlan:
    """What an update puts on the wire and what a dense update would have: the delta telemetry.

    ``mode`` "delta": tensors send their delta when it is smaller than their dense bytes (the update then
    needs receivers that serve the base); "dense": the whole update goes dense (no base needed) because
    the deltas would not have saved enough."""

    mode: Literal["delta", "dense"]
    choices: tuple[WireChoice, ...]
    wire_bytes: int
    dense_bytes: int

    @property
    def ratio(self) -> float:
        """Bytes on the wire per dense byte (1.0 for an empty update)."""
        return self.wire_bytes / self.dense_bytes if self.dense_bytes else 1.0

    @property
    def delta_tensors(self) -> int:
        return sum(1 for c in self.choices if c.send == "delta")

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "tensors": len(self.choices), "delta_tensors": self.delta_tensors,
                "wire_bytes": self.wire_bytes, "dense_bytes": self.dense_bytes, "ratio": round(self.ratio, 6)}


def plan_wire(entries: Sequence[tuple[str, int, int]], max_ratio: float = 1.0) -> WirePlan:
    """Given ``(name, dense_nbytes, encoded_nbytes)`` per tensor, what goes on the wire.

    Each tensor sends its delta when that is strictly smaller than its dense bytes, else its dense bytes.
    If the resulting wire bytes exceed ``max_ratio`` of the dense total, the whole update goes dense (a
    delta that saves little is not worth depending on the receivers' base). ValueError on negative sizes
    or a ratio outside (0, 1].
    """
    if not 0 < max_ratio <= 1:
        raise ValueError(f"max_ratio must be in (0, 1], got {max_ratio}")
    choices: list[WireChoice] = []
    for name, dense, encoded in entries:
        if dense < 0 or encoded < 0:
            raise ValueError(f"tensor {name}: negative size (dense {dense}, encoded {encoded})")
        send: Literal["delta", "dense"] = "delta" if encoded < dense else "dense"
        choices.append(WireChoice(name, send, encoded if send == "delta" else dense, dense))
    dense_total = sum(c.dense_nbytes for c in choices)
    wire_total = sum(c.nbytes for c in choices)
    if dense_total and wire_total > max_ratio * dense_total:
        return WirePlan("dense", tuple(WireChoice(c.name, "dense", c.dense_nbytes, c.dense_nbytes) for c in choices),
                        dense_total, dense_total)
    return WirePlan("delta", tuple(choices), wire_total, dense_total)


def plan_deltas(deltas: Sequence[DeltaSpec], max_ratio: float = 1.0) -> WirePlan:
    """``plan_wire`` over encoded tensors."""
    return plan_wire([(d.name, d.dense_nbytes, d.nbytes) for d in deltas], max_ratio)



# ---- an update's delta: the manifest's part and each bucket's part ------------------------------


@dataclass(frozen=True)
class DeltaEntry:
    """How one tensor of a delta bucket travels: its bytes lie at ``offset`` (``nbytes``) of the wire bucket.
    With ``delta`` they are that patch's payload; without, the tensor's full bytes. ``checksum`` is the one of
    the resulting full tensor (the manifest's algorithm): what the receiver records as served, and what a
    dense update carries."""

    offset: int
    nbytes: int
    checksum: int
    delta: DeltaSpec | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "checksum": self.checksum,
                "delta": self.delta.to_wire() if self.delta is not None else None}

    @classmethod
    def from_wire(cls, raw: Any) -> DeltaEntry:
        _require(isinstance(raw, dict), f"delta entry must be a map, got {type(raw).__name__}")
        delta = raw.get("delta")
        return cls(offset=_int(raw.get("offset"), "delta entry offset"), nbytes=_int(raw.get("nbytes"), "delta entry nbytes"),
                   checksum=_int(raw.get("checksum"), "delta entry checksum", 0, 0xFFFFFFFFFFFFFFFF),
                   delta=DeltaSpec.from_wire(delta) if delta is not None else None)


@dataclass(frozen=True)
class BucketDelta:
    """``BucketHeader.delta``: wire bucket ``index`` of a delta update carries the tensors of full bucket
    ``index`` as patches (or whole), laid out in ``size`` bytes; ``entries`` (one per tensor of the bucket,
    in manifest order) say where each payload lies. Sent with its bucket, so a publisher encodes bucket
    ``i`` while bucket ``i - 1`` is on the wire. The header's checksums are those of the payload bytes (a
    transport error is caught before decoding); each rebuilt tensor is then checked against its
    ``DeltaEntry.checksum``. A bucket of a delta update sent without one carries its full tensors, as a
    dense update's bucket does."""

    size: int
    entries: tuple[DeltaEntry, ...]

    @property
    def wire_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def result_sums(self) -> tuple[int, ...]:
        """The checksums of the full tensors the bucket makes (what a dense bucket's header carries)."""
        return tuple(e.checksum for e in self.entries)

    def wire_specs(self, manifest: Any, index: int) -> list[Any]:
        """The layout of the bucket's payloads as ``TensorSpec``s (manifest order): a tensor sent whole as its
        tensor (dtype and shape, so finiteness is checked as for any update), a patch as ``uint8`` bytes."""
        from bridge.wire import TensorSpec

        out = []
        for spec, entry in zip(manifest.by_bucket()[index], self.entries, strict=True):
            if entry.delta is None:
                out.append(TensorSpec(spec.name, spec.dtype, spec.shape, index, entry.offset, entry.nbytes))
            else:
                out.append(TensorSpec(spec.name, "uint8", (entry.nbytes,), index, entry.offset, entry.nbytes))
        return out

    def to_wire(self) -> dict[str, Any]:
        return {"size": self.size, "entries": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, raw: Any) -> BucketDelta:
        _require(isinstance(raw, dict), "bucket.delta must be a map")
        entries = raw.get("entries")
        _require(isinstance(entries, list) and len(entries) <= 1 << 20, "bucket.delta.entries must be a list")
        return cls(size=_int(raw.get("size"), "bucket.delta.size", 0, 1 << 40),
                   entries=tuple(DeltaEntry.from_wire(e) for e in entries))  # type: ignore[union-attr]

    def check(self, manifest: Any, index: int) -> None:
        """Consistent with bucket ``index`` of the delta update ``manifest``: one entry per tensor of the bucket,
        each patch for that tensor (name, dtype, shape, the manifest's checksum algorithm, its base version,
        the base checksum the manifest named), a size no larger than the full bucket, every payload inside it
        and none overlapping. ManifestError naming the problem (WireError when the update is not a delta)."""
        _require(manifest.delta is not None, f"bucket {index} carries patches but the update is not a delta")
        _require(index < len(manifest.bucket_sizes), f"bucket {index} does not exist", ManifestError)
        specs = manifest.by_bucket()[index]
        _require(len(self.entries) == len(specs),
                 f"bucket {index}: its delta lists {len(self.entries)} entries for {len(specs)} tensors", ManifestError)
        _require(self.size <= manifest.bucket_sizes[index],
                 f"bucket {index}: wire size {self.size} exceeds the full bucket's {manifest.bucket_sizes[index]}", ManifestError)
        delta = manifest.delta
        bases = delta.base_sums(manifest)
        spans = []
        for spec, entry in zip(specs, self.entries, strict=True):
            name, d = spec.name, entry.delta
            if d is None:
                _require(entry.nbytes == spec.nbytes, f"tensor {name}: sent dense in {entry.nbytes} bytes, it has {spec.nbytes}", ManifestError)
            else:
                _require(d.name == name and d.dtype == spec.dtype and d.shape == spec.shape,
                         f"tensor {name}: its patch is for {d.name} {list(d.shape)} {d.dtype}", ManifestError)
                _require(d.checksum == manifest.checksum, f"tensor {name}: patch checksums are {d.checksum}, the manifest's {manifest.checksum}", ManifestError)
                _require(d.base_version == delta.base_version, f"tensor {name}: patch against version {d.base_version}, the update's base is {delta.base_version}", ManifestError)
                _require(d.base_checksum == bases[name],
                         f"tensor {name}: patch against base checksum {d.base_checksum:#x}, the manifest named {bases[name]:#x}", ManifestError)
                _require(d.result_checksum == entry.checksum, f"tensor {name}: patch result checksum differs from its entry's", ManifestError)
                _require(entry.nbytes == d.nbytes, f"tensor {name}: payload of {entry.nbytes} bytes, its patch declares {d.nbytes}", ManifestError)
            _require(entry.offset + entry.nbytes <= self.size,
                     f"tensor {name}: payload [{entry.offset}, {entry.offset + entry.nbytes}) overflows wire bucket {index} "
                     f"of {self.size} bytes", ManifestError)
            spans.append((entry.offset, entry.offset + entry.nbytes, name))
        end, last = 0, ""
        for start, stop, name in sorted(spans):
            _require(start >= end, f"tensor {name}: payload overlaps tensor {last} in wire bucket {index}", ManifestError)
            end, last = stop, name


@dataclass(frozen=True)
class DeltaManifest:
    """``Manifest.delta``: the update travels as patches against version ``base_version``, whose checksum of
    each tensor (``base_checksums``, one per tensor in ``Manifest.tensors`` order) the receiver checks
    against what it serves at ``Begin``, before any payload. Which tensors go as patches, and where their
    payloads lie, travels with each bucket (``BucketDelta``), so nothing of it needs the whole version
    encoded first. ``Manifest.tensors`` and ``bucket_sizes`` keep describing the **full** tensors, as the
    receiver stages them once rebuilt.

    ``buckets`` is never sent: the receiver fills it with the tables its buckets carried (None: a bucket sent
    whole) before the engine finishes the update, for the sync's record (``telemetry``)."""

    base_version: int
    base_checksums: tuple[int, ...]
    buckets: tuple[BucketDelta | None, ...] = ()

    def base_sums(self, manifest: Any) -> dict[str, int]:
        """Tensor name -> checksum of its base."""
        return {t.name: s for t, s in zip(manifest.tensors, self.base_checksums, strict=True)}

    def telemetry(self, manifest: Any) -> dict[str, Any]:
        """Bytes on the wire against dense bytes and the density, overall and per tensor group, from ``buckets``."""
        return update_telemetry(manifest, self.buckets, self.base_version)

    def to_wire(self) -> dict[str, Any]:
        return {"base_version": self.base_version, "base_checksums": list(self.base_checksums)}

    @classmethod
    def from_wire(cls, raw: Any) -> DeltaManifest:
        _require(isinstance(raw, dict), "manifest.delta must be a map")
        sums = raw.get("base_checksums")
        _require(isinstance(sums, list), "manifest.delta.base_checksums must be a list")
        return cls(base_version=_int(raw.get("base_version"), "manifest.delta.base_version"),
                   base_checksums=tuple(_int(s, "base checksum", 0, 0xFFFFFFFFFFFFFFFF) for s in sums))  # type: ignore[union-attr]

    def check(self, manifest: Any) -> None:
        """Consistent with ``manifest``: one base checksum per tensor, the base older than the update.
        ManifestError naming the problem."""
        _require(len(self.base_checksums) == len(manifest.tensors),
                 f"manifest.delta lists {len(self.base_checksums)} base checksums for {len(manifest.tensors)} tensors", ManifestError)
        _require(self.base_version < manifest.version,
                 f"manifest.delta: base version {self.base_version} is not older than version {manifest.version}", ManifestError)


def update_telemetry(manifest: Any, tables: Sequence[BucketDelta | None], base_version: int = 0) -> dict[str, Any]:
    """A sync's wire figures: the base version (0: dense), bytes on the wire, dense bytes, tensors sent as
    patches and their density (changed elements per element of the patched tensors; 0 for dense), and the
    same per tensor group (``bridge.tensor_groups.tensor_group``). ``tables``: each bucket's ``BucketDelta``
    (None or missing: the bucket went whole)."""
    from bridge.tensor_groups import tensor_group

    groups: dict[str, list[int]] = {}  # group -> [wire bytes, dense bytes, changed, patched elements]
    for index, specs in enumerate(manifest.by_bucket()):
        table = tables[index] if index < len(tables) else None
        entries = table.entries if table is not None else (None,) * len(specs)
        for spec, entry in zip(specs, entries, strict=True):
            g = groups.setdefault(tensor_group(spec.name), [0, 0, 0, 0])
            g[0] += entry.nbytes if entry is not None else spec.nbytes
            g[1] += spec.nbytes
            if entry is not None and entry.delta is not None:
                g[2] += entry.delta.changed
                g[3] += entry.delta.numel
    total = [sum(g[i] for g in groups.values()) for i in range(4)]
    delta_tensors = sum(1 for t in tables if t is not None for e in t.entries if e.delta is not None)

    def density(g: list[int]) -> float:
        return round(g[2] / g[3], 6) if g[3] else 0.0

    return {"delta_base": base_version, "wire_bytes": total[0], "dense_bytes": total[1], "delta_tensors": delta_tensors,
            "density": density(total),
            "groups": {name: {"wire_bytes": g[0], "dense_bytes": g[1], "density": density(g)} for name, g in sorted(groups.items())}}


def wire_telemetry(manifest: Any) -> dict[str, Any]:
    """A sync's wire figures for its record (``SyncRecord``), as ``update_telemetry`` gives them: a delta
    update's from the tables its buckets carried, a dense update's as its full bytes."""
    if manifest.delta is not None:
        return dict(manifest.delta.telemetry(manifest))
    return update_telemetry(manifest, ())
