"""Sink routing without an engine: head ranges, the common TP sink loader, the routed loader wrapper,
checkpoint-name mapping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bridge.errors import RouterError
from inference_side.router import (
    HeadRange,
    RoutedLoader,
    SinkLoader,
    init_sink_padding,
    is_sink_name,
    map_checkpoint_name,
    owning_module_path,
    sink_head_range,
)

NEG_INF = float("-inf")

# ---- sink_head_range ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "param_len", "rank", "tp", "expected"),
    [
        (8, 8, 0, 1, HeadRange(0, 8, 8)),
        (8, 4, 0, 2, HeadRange(0, 4, 4)),
        (8, 4, 1, 2, HeadRange(4, 4, 4)),
        (8, 2, 0, 4, HeadRange(0, 2, 2)),
        (8, 2, 3, 4, HeadRange(6, 2, 2)),
        (64, 16, 2, 4, HeadRange(32, 16, 16)),
        # padded runtime parameter (DeepSeek-style): longer than the rank's real heads
        (8, 6, 1, 2, HeadRange(4, 4, 6)),
        (8, 16, 0, 1, HeadRange(0, 8, 16)),
        (12, 4, 3, 4, HeadRange(9, 3, 4)),
    ],
)
def test_sink_head_range(heads: int, param_len: int, rank: int, tp: int, expected: HeadRange) -> None:
    assert sink_head_range(heads, param_len, rank, tp) == expected


@pytest.mark.parametrize(
    ("heads", "param_len", "rank", "tp", "phrase"),
    [
        (6, 2, 0, 4, "6 sink heads do not divide evenly over tensor-parallel size 4"),
        (7, 4, 1, 2, "7 sink heads do not divide evenly over tensor-parallel size 2"),
        # head range wider than the parameter: an error, never silent truncation
        (8, 4, 0, 1, "rank 0 needs 8 sink heads but the runtime parameter holds only 4"),
        (16, 3, 1, 4, "rank 1 needs 4 sink heads but the runtime parameter holds only 3"),
        (8, 4, 2, 2, "invalid tensor-parallel rank 2 of 2"),
        (8, 4, -1, 2, "invalid tensor-parallel rank -1 of 2"),
        (8, 4, 0, 0, "invalid tensor-parallel rank 0 of 0"),
    ],
    ids=["not-divisible-4", "not-divisible-2", "wider-than-param", "wider-than-param-tp4", "rank-too-big",
         "rank-negative", "tp-zero"],
)
def test_sink_head_range_rejects(heads: int, param_len: int, rank: int, tp: int, phrase: str) -> None:
    with pytest.raises(RouterError) as info:
        sink_head_range(heads, param_len, rank, tp, name="model.layers.3.self_attn.sinks")
    assert str(info.value).startswith("model.layers.3.self_attn.sinks: ")
    assert phrase in str(info.value)


# ---- SinkLoader ---------------------------------------------------------------------------------


def _param(n: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((n,), 7.0, dtype=dtype), requires_grad=False)


@pytest.mark.parametrize(
    ("tp", "rank", "param_len"),
    [(1, 0, 8), (2, 0, 4), (2, 1, 4), (4, 2, 2), (4, 3, 2), (2, 1, 6), (4, 3, 5), (1, 0, 10)],
)
def test_sink_loader_writes_rank_shard_in_place(tp: int, rank: int, param_len: int) -> None:
    loaded = torch.arange(8, dtype=torch.float32) + 0.5
    param = _param(param_len)
    ptr = param.data_ptr()
    SinkLoader(rank, tp, "sinks")(param, loaded)
    assert param.data_ptr() == ptr  # written in place
    count = 8 // tp
    assert torch.equal(param.data[:count], loaded[rank * count : (rank + 1) * count])
    padding = param.data[count:]
    assert padding.numel() == param_len - count
    assert bool((padding == NEG_INF).all())


def test_sink_loader_tp2_rank1_padded_exact_values() -> None:
    loaded = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    param = _param(6, torch.bfloat16)
    ptr = param.untyped_storage().data_ptr()
    loader = SinkLoader(tp_rank=1, tp_size=2, name="model.layers.0.self_attn.sinks")
    loader(param, loaded)
    assert param.untyped_storage().data_ptr() == ptr
    assert param.dtype == torch.bfloat16
    assert param.tolist() == [5.0, 6.0, 7.0, 8.0, NEG_INF, NEG_INF]


def test_sink_loader_second_write_updates() -> None:
    """Regression: changed sink values across two reloads must both land."""
    param = _param(6)
    ptr = param.data_ptr()
    loader = SinkLoader(1, 2, "sinks")
    loader(param, torch.arange(8, dtype=torch.float32))
    assert param.tolist() == [4.0, 5.0, 6.0, 7.0, NEG_INF, NEG_INF]
    loader(param, -torch.arange(8, dtype=torch.float32) - 10)
    assert param.tolist() == [-14.0, -15.0, -16.0, -17.0, NEG_INF, NEG_INF]
    assert param.data_ptr() == ptr


def test_sink_loader_rejects_2d_and_uneven() -> None:
    param = _param(4)
    before = param.detach().clone()
    with pytest.raises(RouterError, match=r"sinks must be one-dimensional, got shape \[2, 4\]"):
        SinkLoader(0, 2, "sinks")(param, torch.zeros(2, 4))
    with pytest.raises(RouterError, match="7 sink heads do not divide evenly over tensor-parallel size 2"):
        SinkLoader(0, 2, "sinks")(param, torch.zeros(7))
    with pytest.raises(RouterError, match="holds only 4"):
        SinkLoader(0, 1, "sinks")(param, torch.zeros(8))
    assert torch.equal(param.data, before)  # nothing written, not even partially


def test_sink_loader_has_a_name() -> None:
    # vLLM's reload machinery inspects weight_loader.__name__
    assert SinkLoader(0, 1, "s").__name__ == "weight_bridge_sink_loader"
    assert RoutedLoader(None).__name__ == "weight_bridge_routed_loader"


# ---- init_sink_padding --------------------------------------------------------------------------


def test_init_sink_padding_sets_only_padding() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0, 9.0, 9.0]), requires_grad=False)
    ptr = param.data_ptr()
    rng = init_sink_padding(param, global_heads=8, tp_rank=1, tp_size=2, name="sinks")
    assert rng == HeadRange(4, 4, 6)
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0, NEG_INF, NEG_INF]
    assert param.data_ptr() == ptr


def test_init_sink_padding_unpadded_leaves_param() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]), requires_grad=False)
    assert init_sink_padding(param, 8, 3, 4, "sinks") == HeadRange(6, 2, 2)
    assert param.tolist() == [1.0, 2.0]


def test_init_sink_padding_rejects_uneven() -> None:
    with pytest.raises(RouterError, match="do not divide evenly"):
        init_sink_padding(_param(4), 6, 0, 4, "sinks")


# ---- RoutedLoader -------------------------------------------------------------------------------


class RecordingLoader:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> str:
        self.calls.append((param, loaded_weight, args, kwargs))
        return "original-result"


def test_routed_call_copies_and_skips_original() -> None:
    original = RecordingLoader()
    param = _param(4)
    ptr = param.data_ptr()
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert RoutedLoader(original)(param, weight, wb_routed=True) is None
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert param.data_ptr() == ptr
    assert original.calls == []


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        (("q",), {}),
        ((), {"shard_id": "k"}),
        ((0, "v"), {"expert_id": 3, "shard_id": "w1", "return_success": True}),
        ((), {"wb_routed": False}),
    ],
    ids=["plain", "positional-shard", "kw-shard", "moe", "routed-false"],
)
def test_other_calls_go_to_original_unchanged(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Quantization/shard dispatch is left untouched: the original loader sees exactly the call."""
    original = RecordingLoader()
    param = _param(4)
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    result = RoutedLoader(original)(param, weight, *args, **kwargs)
    assert result == "original-result"
    assert len(original.calls) == 1
    got_param, got_weight, got_args, got_kwargs = original.calls[0]
    assert got_param is param and got_weight is weight
    assert got_args == args
    expected_kwargs = {k: v for k, v in kwargs.items() if k != "wb_routed"}
    assert got_kwargs == expected_kwargs
    assert param.tolist() == [7.0] * 4  # the wrapper itself wrote nothing


def test_routed_loader_without_original_copies() -> None:
    param = _param(3)
    RoutedLoader(None)(param, torch.tensor([1.0, 2.0, 3.0]))
    assert param.tolist() == [1.0, 2.0, 3.0]


# ---- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.self_attn.sinks", True),
        ("model.layers.0.attn.sink", True),
        ("model.layers.0.attn.attn_sink", True),
        ("model.layers.0.attn.attention_sink_bias", True),
        ("sinks", True),
        ("model.layers.0.self_attn.sinks.weight", False),
        ("model.layers.0.self_attn.sinkhorn", False),
        ("model.layers.0.self_attn.q_proj.weight", False),
        ("model.sinks_norm", False),
    ],
)
def test_is_sink_name(name: str, expected: bool) -> None:
    assert is_sink_name(name) is expected


MODULES = {"model", "model.layers", "model.layers.0", "model.layers.0.self_attn", "model.layers.0.self_attn.qkv_proj", "lm_head"}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("model.layers.0.self_attn.sinks", "model.layers.0.self_attn"),
        ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj"),
        ("model.layers.0.mlp.down_proj.weight", "model.layers.0"),  # 'mlp' not registered: deepest known prefix
        ("lm_head.weight", "lm_head"),
        ("bias", ""),
        ("other.weight", ""),
        ("model.layers.0.self_attn", "model.layers.0"),  # a path is not its own owner
        ("modelx.weight", ""),  # prefix by component, not by characters
    ],
)
def test_owning_module_path(path: str, expected: str) -> None:
    assert owning_module_path(MODULES, path) == expected


@pytest.fixture(scope="module")
def weights_mapper() -> Any:
    utils = pytest.importorskip("vllm.model_executor.models.utils")  # imports vLLM code, starts no engine
    return utils.WeightsMapper


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.self_attn.sinks", "model.layers.0.attn.sinks"),
        ("model.layers.12.self_attn.q_proj.weight", "model.layers.12.attn.q_proj.weight"),
        ("model.layers.0.mlp.weight", "model.layers.0.mlp.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_map_checkpoint_name_with_vllm_mapper(weights_mapper: Any, name: str, expected: str) -> None:
    model = SimpleNamespace(hf_to_vllm_mapper=weights_mapper(orig_to_new_substr={".self_attn.": ".attn."}))
    assert map_checkpoint_name(model, name) == expected


def test_map_checkpoint_name_dropped_by_mapper(weights_mapper: Any) -> None:
    model = SimpleNamespace(hf_to_vllm_mapper=weights_mapper(orig_to_new_prefix={"rotary_emb.": None}))
    assert map_checkpoint_name(model, "rotary_emb.inv_freq") is None
    assert map_checkpoint_name(model, "model.norm.weight") == "model.norm.weight"


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.sinks", "lm_head.weight", ""])
def test_map_checkpoint_name_without_mapper(name: str) -> None:
    assert map_checkpoint_name(object(), name) == name
    assert map_checkpoint_name(SimpleNamespace(hf_to_vllm_mapper=None), name) == name


class OldStyleMapper:
    """A mapper with only ``_map_name`` (older vLLM)."""

    def _map_name(self, key: str) -> str | None:
        return None if key.startswith("drop.") else key.replace("old", "new")


@pytest.mark.parametrize(("name", "expected"), [("model.old.weight", "model.new.weight"), ("drop.me", None)])
def test_map_checkpoint_name_old_style_mapper(name: str, expected: str | None) -> None:
    assert map_checkpoint_name(SimpleNamespace(hf_to_vllm_mapper=OldStyleMapper()), name) == expected
