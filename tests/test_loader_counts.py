"""vLLM's layerwise reload counts each weight loader call's writes by running the loader on meta tensors first; during
the bridge's updates ``reload_hooks.LoaderCounts`` reuses that answer once two updates agreed on it. Here with vLLM's
own ``get_numel_loaded`` (its ``CopyCounter`` over a real loader on real meta tensors), the loaders plain functions
and bound methods like vLLM's. The engine-level check (a real engine reusing every count and still equal to a
cold-loaded one after many updates) is in tests/test_delta_sync.py."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from inference_side.reload_hooks import LoaderCounts, loader_call_key  # noqa: E402


class Calls:
    def __init__(self) -> None:
        self.n = 0


def make_loader(calls: Calls, ret: Any = None) -> Any:
    def weight_loader(param: Any, loaded_weight: Any, shard_id: str | None = None) -> Any:
        calls.n += 1
        rows = loaded_weight.shape[0]
        start = {"q": 0, "k": rows, None: 0}[shard_id]
        param.narrow(0, start, rows).copy_(loaded_weight)
        return ret
    return weight_loader


def bound(loader: Any, *args: Any, **kwargs: Any) -> inspect.BoundArguments:
    b = inspect.signature(loader).bind(*args, **kwargs)
    b.apply_defaults()
    return b


def count(counts: LoaderCounts, loader: Any, args: inspect.BoundArguments, name: str | None = "w") -> tuple[int, Any]:
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded

    return counts.count(get_numel_loaded, loader, args, name)


def meta(rows: int = 8, cols: int = 4) -> Any:
    return torch.empty(rows, cols, device="meta")


def test_a_count_is_reused_once_two_updates_agreed_and_equals_the_meta_run() -> None:
    calls, counts, model = Calls(), LoaderCounts(), torch.nn.Linear(1, 1)
    loader = make_loader(calls, ret=True)
    answers = []
    for _ in range(4):
        counts.start(model)
        answers.append(count(counts, loader, bound(loader, meta(), meta(4, 4), "k")))
    assert answers == [(16, True)] * 4
    assert calls.n == 2 and counts.reused == 1


@pytest.mark.parametrize("change", ["shape", "dtype", "shard", "tensor name", "param shape"])
def test_a_call_that_differs_in_what_decides_the_count_runs_the_loader(change: str) -> None:
    calls, counts, model = Calls(), LoaderCounts(), torch.nn.Linear(1, 1)
    loader = make_loader(calls)
    for _ in range(2):
        counts.start(model)
        count(counts, loader, bound(loader, meta(), meta(4, 4), "q"))
    counts.start(model)
    param, weight, shard, name = meta(), meta(4, 4), "q", "w"
    if change == "shape":
        weight = meta(2, 4)
    elif change == "dtype":
        weight = torch.empty(4, 4, device="meta", dtype=torch.bfloat16)
    elif change == "shard":
        shard = "k"
    elif change == "tensor name":
        name = "other"
    else:
        param = meta(16, 4)
    before = calls.n
    numel, _ = count(counts, loader, bound(loader, param, weight, shard), name)
    assert calls.n == before + 1 and counts.reused == 0
    assert numel == weight.numel()


def test_runs_that_disagree_are_never_reused() -> None:
    calls, counts, model = Calls(), LoaderCounts(), torch.nn.Linear(1, 1)
    flip = {"ret": 0}

    def loader(param: Any, loaded_weight: Any) -> Any:
        calls.n += 1
        param.narrow(0, 0, loaded_weight.shape[0]).copy_(loaded_weight)
        flip["ret"] ^= 1
        return flip["ret"]

    for _ in range(4):
        counts.start(model)
        count(counts, loader, bound(loader, meta(), meta(4, 4)))
    assert calls.n == 4 and counts.reused == 0


@pytest.mark.parametrize("case", ["object returned", "object argument", "outside an update", "no tensor name"])
def test_calls_it_cannot_key_or_keep_always_run(case: str) -> None:
    calls, counts, model = Calls(), LoaderCounts(), torch.nn.Linear(1, 1)
    loader = make_loader(calls, ret=object() if case == "object returned" else None)

    def with_object(param: Any, loaded_weight: Any, extra: Any) -> None:
        loader(param, loaded_weight)

    for _ in range(4):
        counts.start(model)
        if case == "outside an update":
            counts.active = False
        if case == "object argument":
            count(counts, with_object, bound(with_object, meta(), meta(4, 4), {"not": "plain"}))
        else:
            count(counts, loader, bound(loader, meta(), meta(4, 4)), None if case == "no tensor name" else "w")
    assert calls.n == 4 and counts.reused == 0


def test_a_failed_update_and_another_model_forget_what_was_learned() -> None:
    calls, counts = Calls(), LoaderCounts()
    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    loader = make_loader(calls)
    args = bound(loader, meta(), meta(4, 4))
    for _ in range(2):
        counts.start(model)
        count(counts, loader, args)
    counts.forget()  # learned again from scratch: two more runs before a reuse
    for _ in range(3):
        counts.start(model)
        count(counts, loader, args)
    assert calls.n == 4 and counts.reused == 1
    counts.start(other)
    count(counts, loader, args)
    assert calls.n == 5 and counts.reused == 0


def test_bound_loaders_are_told_apart_by_their_module() -> None:
    class Layer(torch.nn.Module):
        def weight_loader(self, param: Any, loaded_weight: Any) -> None:
            param.copy_(loaded_weight)

    a, b = Layer(), Layer()
    key_a = loader_call_key("w", a.weight_loader, {"loaded_weight": meta()})
    assert key_a == loader_call_key("w", a.weight_loader, {"loaded_weight": meta()})  # a new bound method each access
    assert key_a != loader_call_key("w", b.weight_loader, {"loaded_weight": meta()})
    assert loader_call_key("w", a.weight_loader, {"loaded_weight": meta().t()}) != key_a  # strides
    assert loader_call_key("w", a.weight_loader, {"shard": ("q", 1)}) is not None
    assert loader_call_key("w", a.weight_loader, {"shard": ["q", 1]}) is None
