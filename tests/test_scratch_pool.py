"""The reload's scratch pool (inference_side/reload_hooks.py ``ScratchPool``) on real torch tensors: what it
keeps between updates and what it must never keep. The engine-level check (a 50m engine whose embedding and
LM head go through the pool stays bit-exact over updates) is in tests/test_delta_sync.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


class Param(torch.Tensor):
    """Stands for vLLM's parameter classes: materialization gives the tensor the placeholder's class and
    attributes."""


def placeholder(shape: tuple[int, ...] = (64, 32)) -> torch.Tensor:
    meta = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    meta.__class__ = Param
    meta.weight_loader = "its loader"  # type: ignore[attr-defined]
    return meta


def vllm_materialize(meta: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's ``materialize_meta_tensor``."""
    tensor = torch.empty_strided(size=tuple(meta.size()), stride=tuple(meta.stride()), dtype=meta.dtype, requires_grad=False)
    tensor.__class__ = meta.__class__
    tensor.__dict__ = meta.__dict__.copy()
    return tensor


def pool(min_bytes: int = 1024) -> object:
    from inference_side.reload_hooks import ScratchPool

    p = ScratchPool(min_bytes=min_bytes)
    p.active = True
    return p


def test_a_settled_tensor_nothing_else_holds_is_lent_again() -> None:
    p = pool()
    first = p.materialize(vllm_materialize, placeholder())
    ptr = first.data_ptr()
    first.fill_(1)
    del first
    p.settle()
    assert p.nbytes == 64 * 32 * 2
    again = p.materialize(vllm_materialize, placeholder())
    assert again.data_ptr() == ptr and type(again) is Param and again.weight_loader == "its loader"
    assert tuple(again.shape) == (64, 32) and again.dtype == torch.bfloat16 and not again.requires_grad
    assert p.nbytes == 0  # lent out again


@pytest.mark.parametrize("holder", ["python reference", "view of its storage", "dropped update"])
def test_what_something_else_may_still_read_is_never_kept(holder: str) -> None:
    p = pool()
    tensor = p.materialize(vllm_materialize, placeholder())
    kept: list[torch.Tensor] = []
    if holder == "python reference":
        kept.append(tensor)
    elif holder == "view of its storage":
        kept.append(tensor[3:5])  # a kernel handle or an alias would hold the storage like this
    del tensor
    if holder == "dropped update":
        p.drop()
    p.settle()
    assert p.nbytes == 0
    fresh = p.materialize(vllm_materialize, placeholder())
    assert all(fresh.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() for k in kept)


def test_small_tensors_inactive_pools_and_other_devices_take_vllms_path() -> None:
    calls = []

    def counting(meta: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(meta.shape))
        return vllm_materialize(meta)

    small = pool(min_bytes=64 * 32 * 2 + 1)
    small.materialize(counting, placeholder())
    idle = pool()
    idle.active = False
    idle.materialize(counting, placeholder())
    meta_device = pool()
    with torch.device("meta"):
        meta_device.materialize(lambda m: m, placeholder())
    assert calls == [(64, 32), (64, 32)]
    assert not small.lent and not idle.lent and not meta_device.lent


def _recording_model(written: dict[str, int]) -> torch.nn.Module:
    """Two bf16 linear layers whose parameters' loaders note the storage they write into (vLLM calls a loader
    twice in a reload: counting, on meta, then loading), prepared for vLLM's layerwise reload."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 16, bias=False)).to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_(False)

        def load(param: torch.Tensor, loaded_weight: torch.Tensor, _name: str = name) -> None:  # vLLM's argument names
            if not param.is_meta:
                written[_name] = param.untyped_storage().data_ptr()
            default_weight_loader(param, loaded_weight)

        p.weight_loader = load  # type: ignore[attr-defined]
    record_metadata_for_reloading(model)
    return model


def _reload(model: torch.nn.Module, new: dict[str, torch.Tensor], in_place: bool) -> None:
    """One update of ``model`` through vLLM's own layerwise reload, the bridge's hooks installed as in a
    worker, each parameter written by its loader."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from inference_side import reload_hooks

    reload_hooks.install()
    reload_hooks.SCRATCH.start(in_place)
    try:
        initialize_layerwise_reload(model)
        params = dict(model.named_parameters())
        for name, value in new.items():
            params[name].weight_loader(params[name], value)
        finalize_layerwise_reload(model, None)
    finally:
        reload_hooks.SCRATCH.active = False


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "fresh"])
def test_vllms_reload_writes_into_the_served_tensors_only_in_place(in_place: bool) -> None:
    """vLLM's layerwise reload with the bridge's hooks: in place, every loader writes into the storage the
    model serves (nothing materialized afresh, nothing kept by the pool); otherwise into fresh memory that
    vLLM copies back. Either way the model ends with the new values in its original storages."""
    from inference_side import reload_hooks

    written: dict[str, int] = {}
    model = _recording_model(written)
    served = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    for step in range(2):
        new = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        written.clear()
        _reload(model, new, in_place)
        assert written.keys() == new.keys()
        assert (written == served) is in_place, (written, served)
        nbytes = sum(v.numel() * 2 for v in new.values())
        assert reload_hooks.SCRATCH.materialized == {"in_place": nbytes if in_place else 0, "pooled": 0,
                                                     "fresh": 0 if in_place else nbytes}
        for name, p in model.named_parameters():
            assert torch.equal(p, new[name]) and p.untyped_storage().data_ptr() == served[name], (step, name)
        reload_hooks.SCRATCH.settle()
        assert reload_hooks.SCRATCH.nbytes == 0  # below the pool's size, or views of served tensors
