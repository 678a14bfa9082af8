"""What a worker checks after an update, before it reports success: the write audit (every tensor sent
was written through a weight loader into a layer that vLLM copied back into its kernel tensors; routed
sinks hold what was sent; backend copies of sinks agree) and the storage identity (no parameter, buffer or
backend alias changed storage). Each check returns the problems it found, one line each."""

from __future__ import annotations

from typing import Any

from inference_side import reload_hooks

StorageKey = tuple[int, tuple[int, ...], str, str]


def storage_key(t: Any) -> StorageKey:
    try:
        ptr = int(t.untyped_storage().data_ptr())
    except (RuntimeError, ValueError):
        ptr = -1
    return (ptr, tuple(t.shape), str(t.dtype), str(t.device))


def snapshot(model: Any, sinks: dict[str, Any]) -> dict[str, StorageKey]:
    """Where every parameter, buffer and backend sinks alias lives now."""
    out = {f"param:{n}": storage_key(p) for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": storage_key(b) for n, b in model.named_buffers()})
    for path, binding in sinks.items():
        impl_sinks = getattr(binding.impl, "sinks", None)
        if impl_sinks is not None:
            out[f"backend:{path}"] = storage_key(impl_sinks)
    return out


def identity_violations(before: dict[str, StorageKey], after: dict[str, StorageKey]) -> list[str]:
    """Every storage of ``before`` that is not the same in ``after``."""
    bad = []
    for key, value in before.items():
        now = after.get(key)
        if now != value:
            bad.append(f"{key} {value} -> {now}")
    return bad


def stale_tensors(model: Any, loaded: list[str], skipped: list[str], param_owner: dict[int, str],
                  routed_sinks: dict[str, Any], sinks: dict[str, Any]) -> list[str]:
    """The write audit over the reload's recorded writes (reload_hooks.RECORDER)."""
    import torch

    rec = reload_hooks.RECORDER
    problems: list[str] = []
    skip = set(skipped)
    for name in loaded:
        if name in skip:
            continue
        if not rec.writes.get(name):
            problems.append(f"{name}: sent but never written through a weight loader (stale)")
            continue
        owners = {param_owner.get(pid) for pid, _ in rec.writes[name]}
        for owner in owners:
            if owner is None:
                continue
            module = model.get_submodule(owner) if owner else model
            if id(module) not in rec.processed_layers:
                problems.append(f"{name}: layer '{owner}' was not copied into its kernel tensors (stale)")
    for path, (expected, rng, _binding) in routed_sinks.items():
        live = model.get_parameter(path)
        got = live.data[: rng.count]
        if not torch.equal(got, expected.to(live.dtype)):
            problems.append(f"{path}: live sinks differ from the sent shard (stale)")
        if rng.padded > rng.count and not bool(torch.isneginf(live.data[rng.count :]).all()):
            problems.append(f"{path}: padded sink heads are not -inf")
    problems.extend(alias_problems(model, sinks))
    return problems


def refresh_backend_aliases(model: Any, sinks: dict[str, Any]) -> int:
    """Where an attention backend keeps its own converted copy of the sinks, refresh it in place."""
    refreshed = 0
    for path, binding in sinks.items():
        impl_sinks = getattr(binding.impl, "sinks", None)
        if impl_sinks is None:
            continue
        param = model.get_parameter(path)
        if storage_key(impl_sinks)[0] == storage_key(param)[0]:
            continue
        n = min(impl_sinks.shape[0], param.shape[0])
        import torch

        with torch.inference_mode():  # the backend made its copy inside a forward pass
            impl_sinks[:n].copy_(param.data[:n].to(impl_sinks.dtype))
        refreshed += 1
    return refreshed


def alias_problems(model: Any, sinks: dict[str, Any]) -> list[str]:
    """Backend sinks copies that differ from their parameter."""
    import torch

    problems = []
    for path, binding in sinks.items():
        impl_sinks = getattr(binding.impl, "sinks", None)
        if impl_sinks is None:
            continue
        param = model.get_parameter(path)
        n = min(impl_sinks.shape[0], param.shape[0])
        if not torch.equal(impl_sinks.data[:n], param.data[:n].to(impl_sinks.dtype)):
            problems.append(f"{path}: the attention backend's sinks copy differs from the parameter (stale)")
    return problems
