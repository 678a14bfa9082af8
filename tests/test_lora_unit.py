"""What an engine admits of a LoRA adapter update (inference_side/lora.py), without an engine; and the
served-checksum scope that keeps each adapter's tensors apart (bridge/served.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bridge import wire
from bridge.errors import ManifestError, VersionError
from bridge.served import ServedContent, served_scope
from inference_side.lora import bucket_tensors, linear_modules, validate_adapter, write_peft_dir


@dataclass
class _Entry:
    shape: tuple[int, ...]
    dtype: str = "bfloat16"


TABLE = {
    "model.embed_tokens.weight": _Entry((512, 128)),
    "lm_head.weight": _Entry((512, 128)),
    "model.norm.weight": _Entry((128,)),
    **{f"model.layers.{i}.self_attn.{m}.weight": _Entry((128, 128)) for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"model.layers.{i}.mlp.{m}.weight": _Entry((256, 128)) for i in range(2) for m in ("gate_proj", "up_proj")},
    **{f"model.layers.{i}.mlp.down_proj.weight": _Entry((128, 256)) for i in range(2)},
}
P = "base_model.model.model.layers.{i}.{m}"


def _manifest(parts: list[tuple[str, tuple[int, ...]]], version: int = 1, dtype: str = "bfloat16", **config: Any) -> wire.Manifest:
    specs, offset = [], 0
    for name, shape in parts:
        n = 1
        for d in shape:
            n *= d
        specs.append(wire.TensorSpec(name, dtype, shape, 0, offset, n * wire.DTYPE_SIZES[dtype]))
        offset += -(-n * wire.DTYPE_SIZES[dtype] // 64) * 64
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], **config}
    return wire.Manifest(version=version, tensors=tuple(specs), bucket_sizes=(max(offset, 1),), adapter=wire.AdapterSpec("math", cfg))


def _good(r: int = 4) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for i in range(2):
        q, d = P.format(i=i, m="self_attn.q_proj"), P.format(i=i, m="mlp.down_proj")
        out += [(f"{q}.lora_A.weight", (r, 128)), (f"{q}.lora_B.weight", (128, r)),
                (f"{d}.lora_A.weight", (r, 256)), (f"{d}.lora_B.weight", (128, r))]
    return out


def test_linear_modules_skip_embeddings_and_norms() -> None:
    mods = linear_modules(TABLE)
    assert "model.layers.0.mlp.down_proj" in mods and mods["model.layers.0.mlp.down_proj"] == (128, 256)
    assert not any(m.endswith(("embed_tokens", "lm_head", "norm")) for m in mods)


def test_a_good_adapter_is_admitted() -> None:
    assert validate_adapter(_manifest(_good()), TABLE, 8, None) is None
    assert validate_adapter(_manifest(_good(), version=3), TABLE, 8, 2) is None


def test_versions_count_per_adapter() -> None:
    assert validate_adapter(_manifest(_good(), version=2), TABLE, 8, 2) == "adapter math version 2 already served"
    with pytest.raises(VersionError, match="adapter math: version 1 is older than the served version 2"):
        validate_adapter(_manifest(_good(), version=1), TABLE, 8, 2)


REFUSED = [
    ("no lora", lambda: (_manifest(_good()), None), "this engine was started without LoRA"),
    ("rank", lambda: (_manifest(_good(16), r=16), 8), "rank r=16 is larger than the engine's max_lora_rank 8"),
    ("target", lambda: (_manifest(_good(), target_modules=["q_proj", "down_proj", "w_proj"]), 8), "unknown target module 'w_proj'"),
    ("target pattern", lambda: (_manifest(_good(), target_modules=".*proj"), 8), "is not a module name"),
    ("embedding target", lambda: (_manifest(_good(), target_modules=["q_proj", "down_proj", "lm_head"]), 8), "unknown target module 'lm_head'"),
    ("dora", lambda: (_manifest(_good(), use_dora=True), 8), "DoRA (use_dora) is not supported"),
    ("bias", lambda: (_manifest(_good(), bias="all"), 8), "bias='all' is not supported"),
    ("not peft", lambda: (_manifest([("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 128))]), 8), "is not a PEFT LoRA weight"),
    ("no module", lambda: (_manifest([(P.format(i=7, m="self_attn.q_proj") + ".lora_A.weight", (4, 128))]), 8),
     "the model has no linear layer 'model.layers.7.self_attn.q_proj'"),
    ("off target", lambda: (_manifest([*_good(), (P.format(i=0, m="self_attn.k_proj") + ".lora_A.weight", (4, 128))]), 8),
     "module 'model.layers.0.self_attn.k_proj' is not among the target modules"),
    ("A shape", lambda: (_manifest([(P.format(i=0, m="mlp.down_proj") + ".lora_A.weight", (4, 128))]), 8),
     "shape [4, 128] does not match [4, 256] (rank 4, base weight [128, 256])"),
    ("B rank", lambda: (_manifest([(P.format(i=0, m="self_attn.q_proj") + ".lora_B.weight", (128, 2))]), 8), "does not match [128, 4]"),
    ("half", lambda: (_manifest(_good()[:1]), 8), "has only lora_A (a LoRA module needs lora_A and lora_B)"),
    ("int dtype", lambda: (_manifest(_good(), dtype="int32"), 8), "dtype int32 is not a LoRA weight dtype"),
    ("empty", lambda: (_manifest([]), 8), "the update carries no tensors"),
]


@pytest.mark.parametrize(("make", "phrase"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_with_the_reason(make: Any, phrase: str) -> None:
    manifest, max_rank = make()
    with pytest.raises(ManifestError) as info:
        validate_adapter(manifest, TABLE, max_rank, None)
    assert phrase in str(info.value)
    assert str(info.value).startswith("adapter math:")


def test_served_checksums_are_kept_per_adapter() -> None:
    base = _manifest(_good())
    other = wire.Manifest(version=1, tensors=base.tensors, bucket_sizes=base.bucket_sizes,
                          adapter=wire.AdapterSpec("code", dict(base.adapter.config)))  # type: ignore[union-attr]
    plain = wire.Manifest(version=1, tensors=base.tensors, bucket_sizes=base.bucket_sizes)
    served = ServedContent()
    names = [t.name for t in base.tensors]
    served.record("crc32", {n: i for i, n in enumerate(names)}, names, served_scope(base))
    assert served.lookup(base) == list(range(len(names)))
    assert served.lookup(other) is None and served.lookup(plain) is None
    # a new version of the adapter with fewer tensors forgets the ones it no longer has
    served.record("crc32", {names[0]: 42}, names[:1], served_scope(base))
    assert served.lookup(base) is None
    assert served.sums == {served_scope(base) + names[0]: 42}


def test_bucket_tensors_and_peft_dir_round_trip(tmp_path: Path) -> None:
    import json

    import torch
    from safetensors.torch import load_file

    a = torch.arange(8, dtype=torch.float32).reshape(2, 4).to(torch.bfloat16)
    b = torch.full((4, 2), -1.5, dtype=torch.bfloat16)
    data = bytearray(128)
    data[0:16] = a.view(torch.uint8).numpy().tobytes()
    data[64:80] = b.view(torch.uint8).numpy().tobytes()
    specs = [wire.TensorSpec("x.lora_A.weight", "bfloat16", (2, 4), 0, 0, 16), wire.TensorSpec("x.lora_B.weight", "bfloat16", (4, 2), 0, 64, 16)]
    got = bucket_tensors(memoryview(bytes(data)), specs)
    assert torch.equal(got["x.lora_A.weight"], a) and torch.equal(got["x.lora_B.weight"], b)
    path = write_peft_dir(tmp_path / "a", {"r": 2, "lora_alpha": 4, "target_modules": ["x"]}, got)
    assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"
    back = load_file(str(path / "adapter_model.safetensors"))
    assert torch.equal(back["x.lora_B.weight"], b)
    with pytest.raises(FileExistsError):  # a version's directory is never written over
        write_peft_dir(tmp_path / "a", {"r": 2}, got)


def test_doors_without_lora_refuse_adapters_by_name() -> None:
    """``validate_manifest`` (the ``vllm serve`` backend's check) names the adapter instead of its tensors."""
    from inference_side.validate import validate_manifest

    with pytest.raises(ManifestError, match="adapter math: this engine takes no LoRA adapter updates"):
        validate_manifest(_manifest(_good()), TABLE, "bfloat16", 0)


# ---- the vllm serve adapter route's check (inference_side/lora.py check_activation) ----------------------------

def test_marker_written_last_is_read_back(tmp_path: Path) -> None:
    from inference_side.lora import MARKER, read_marker, write_marker

    assert read_marker(tmp_path) is None
    write_marker(tmp_path, "math", 3, 4, ("q_proj", "v_proj"))
    assert read_marker(tmp_path) == {"name": "math", "version": 3, "rank": 4, "target_modules": ["q_proj", "v_proj"]}
    assert [p.name for p in tmp_path.iterdir()] == [MARKER]
    (tmp_path / MARKER).write_text("[1, 2]")
    assert read_marker(tmp_path) is None


MARK = {"name": "math", "version": 3}


@pytest.mark.parametrize(("marker", "version", "served", "error", "expected"), [
    (MARK, 3, None, None, None),
    (MARK, 3, 2, None, None),
    (MARK, 3, 3, None, "adapter math version 3 already served"),
    (MARK, 3, 4, VersionError, "adapter math: version 3 is older than the served version 4"),
    (None, 3, None, ManifestError, "/d is not an adapter directory the weight_bridge backend verified"),
    ({"name": "code", "version": 3}, 3, None, ManifestError, "/d holds adapter 'code' version 3, not 'math' version 3"),
    (MARK, 5, None, ManifestError, "/d holds adapter 'math' version 3, not 'math' version 5"),
], ids=["first", "newer", "same", "older", "unmarked", "other adapter", "other version"])
def test_the_adapter_route_serves_only_a_verified_newer_version(marker: Any, version: int, served: int | None,
                                                                  error: Any, expected: str | None) -> None:
    from inference_side.lora import check_activation

    if error is None:
        assert check_activation(marker, "/d", "math", version, served) == expected
    else:
        with pytest.raises(error, match=expected):
            check_activation(marker, "/d", "math", version, served)


# ---- the read-back's own transforms (inference_side/lora_audit.py), checked by hand ------------------------

@pytest.mark.parametrize(("config", "want"), [({"r": 4, "lora_alpha": 8}, 2.0), ({"r": 4}, 2.0),
                                              ({"r": 16, "lora_alpha": 8, "use_rslora": True}, 2.0),
                                              ({"r": 8, "lora_alpha": 8}, 1.0)])
def test_adapter_scaling_is_peft_s(config: dict[str, Any], want: float) -> None:
    from inference_side.lora_audit import adapter_scaling

    assert adapter_scaling(config) == want


@pytest.mark.parametrize(("kind", "tp_rank", "in_part", "out_part", "shard_id", "a_cols", "b_rows"), [
    ("replicated", 0, 6, 8, 0, (0, 6), (0, 8)),
    ("column", 0, 6, 4, 0, (0, 6), (0, 4)),
    ("column", 1, 6, 4, 1, (0, 6), (4, 8)),
    ("column", 1, 6, 2, 0, (0, 6), (0, 2)),  # a KV slice whose heads rank 1 shares with rank 0
    ("row", 1, 3, 8, 1, (3, 6), (0, 8)),
])
def test_shard_takes_this_ranks_part(kind: str, tp_rank: int, in_part: int, out_part: int, shard_id: int,
                                     a_cols: tuple[int, int], b_rows: tuple[int, int]) -> None:
    import torch

    from inference_side.lora_audit import shard

    a, b = torch.arange(2 * 6).reshape(2, 6), torch.arange(8 * 2).reshape(8, 2)
    got_a, got_b = shard(kind, a, b, tp_rank, in_part, out_part, shard_id)
    assert torch.equal(got_a, a[:, a_cols[0]:a_cols[1]]) and torch.equal(got_b, b[b_rows[0]:b_rows[1]])
    with pytest.raises(ValueError, match="no LoRA layer kind 'moe'"):
        shard("moe", a, b, 0, 1, 1, 0)


def test_packed_tensors_round_trip_bit_for_bit() -> None:
    import torch

    from inference_side.lora_audit import pack_tensors, unpack_tensors

    tensors = {"x": torch.randn(3, 5).to(torch.bfloat16), "y": torch.tensor([[float("nan"), -0.0]])}
    back = unpack_tensors(pack_tensors(tensors))
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8))


def test_base_moved_names_storage_and_checksum_changes() -> None:
    import torch

    from inference_side.lora_audit import base_moved, fingerprint

    model = torch.nn.Linear(4, 3)
    before = fingerprint(model)
    assert base_moved(before, fingerprint(model)) == []
    with torch.no_grad():
        model.bias[0] += 1
    assert [m.split(":")[1] for m in base_moved(before, fingerprint(model))] == ["bias"]
    model.weight = torch.nn.Parameter(model.weight.detach().clone())
    moved = base_moved(before, fingerprint(model))
    assert any(m.startswith("param:weight: storage") for m in moved)


def test_readback_rank_kinds() -> None:
    from bridge.report import FailureKind
    from inference_side.lora_audit import readback_rank

    ok = readback_rank({"rank": 1, "modules": 4, "mismatches": [], "base_moved": [], "seconds": 0.1})
    assert ok.ok and ok.tensors == 8 and ok.rank == 1
    stale = readback_rank({"rank": 0, "modules": 4, "mismatches": ["m.lora_B: 1 of 8 values differ"], "mismatch_count": 3})
    assert (stale.ok, stale.kind) == (False, FailureKind.STALE) and "3 mismatch(es)" in stale.error
    moved = readback_rank({"rank": 0, "modules": 4, "mismatches": [], "base_moved": ["param:w: checksum 1 -> 2"]})
    assert (moved.ok, moved.kind) == (False, FailureKind.IDENTITY) and "param:w" in moved.error
