"""A minimal LoRA for the trainer's policy, in PEFT's layout: what the GRPO example trains with ``--lora R``
and what the benchmark publishes as an adapter (PEFT itself is not a dependency).

``add_lora(model, settings)`` freezes every base weight and wraps each target ``nn.Linear`` (by default every
linear layer of a decoder block: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``) so that ``y = W x + (alpha / r) * B (A x)``, with ``A`` ``[r, in]`` initialised as PEFT
does (Kaiming-uniform) and ``B`` ``[out, r]`` at zero: the wrapped model starts exactly as the base.
``adapter_tensors(model)`` are the adapter's tensors named as PEFT saves them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), ``adapter_spec(model, name)`` the
matching ``AdapterSpec`` (its PEFT config), ``merged_tensors(model)`` the full weights with the adapter merged
in (``W + (alpha / r) * B A``, as PEFT merges), as a trainer without adapter sync would publish them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge import wire
from bridge.errors import ConfigError

PEFT_PREFIX = "base_model.model."
# every linear layer of a Qwen2/Llama decoder block (PEFT's "all-linear" for these models, lm_head aside)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASettings:
    """``rank`` r, ``alpha`` (scaling ``alpha / r``; PEFT's ``lora_alpha``) and the target module names."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _lora_linear_class() -> Any:
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        """``base(x) + scaling * lora_B(lora_A(x))``; ``base`` is frozen."""

        def __init__(self, base: nn.Linear, rank: int, scaling: float) -> None:
            super().__init__()
            self.base_layer = base
            self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
            self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
            self.scaling = scaling
            nn.init.kaiming_uniform_(self.lora_A.weight, a=5 ** 0.5)  # as PEFT initialises A
            nn.init.zeros_(self.lora_B.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling

    return LoRALinear


def add_lora(model: Any, settings: LoRASettings, seed: int = 0) -> list[str]:
    """Freeze ``model`` and wrap every ``nn.Linear`` whose last name part is a target with a LoRA (A seeded
    with ``seed``, B zero: outputs unchanged until trained); returns the wrapped module paths. Raises
    ``ConfigError`` for a rank below 1 or when no module matches a target."""
    import torch
    from torch import nn

    if settings.rank < 1:
        raise ConfigError(f"LoRA rank must be at least 1, got {settings.rank}")
    lora_linear = _lora_linear_class()
    for param in model.parameters():
        param.requires_grad_(False)
    paths = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in settings.targets]
    missing = sorted(set(settings.targets) - {p.rsplit(".", 1)[-1] for p in paths})
    if missing:
        raise ConfigError(f"LoRA target modules {missing} are not linear layers of the model")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for path in paths:
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, leaf, lora_linear(getattr(parent, leaf), settings.rank, settings.scaling))
    finally:
        torch.random.set_rng_state(state)
    model.lora_settings = settings
    return paths


def _wrapped(model: Any) -> list[tuple[str, Any]]:
    modules = [(name, m) for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    if not modules:
        raise ConfigError("the model has no LoRA modules (add_lora first)")
    return modules


def adapter_tensors(model: Any) -> list[tuple[str, Any]]:
    """The adapter's tensors (detached), PEFT-named: per wrapped module ``lora_A.weight`` then ``lora_B.weight``."""
    out = []
    for path, module in _wrapped(model):
        out.append((f"{PEFT_PREFIX}{path}.lora_A.weight", module.lora_A.weight.detach()))
        out.append((f"{PEFT_PREFIX}{path}.lora_B.weight", module.lora_B.weight.detach()))
    return out


def adapter_spec(model: Any, name: str) -> wire.AdapterSpec:
    """The ``AdapterSpec`` of ``model``'s LoRA: ``adapter_config.json`` as PEFT writes it for these settings."""
    settings: LoRASettings = model.lora_settings
    return wire.AdapterSpec(name, {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank,
                                   "lora_alpha": settings.alpha, "target_modules": list(settings.targets),
                                   "lora_dropout": 0.0, "bias": "none"})


def merged_tensors(model: Any) -> list[tuple[str, Any]]:
    """Every base weight under its checkpoint name, the targets with the adapter merged in: a full update.
    As PEFT merges on CPU: ``scaling * B @ A`` in float32, cast to the base weight's dtype and added there
    (into new tensors: the base stays as it is, so the trainer keeps training the adapter)."""
    import torch

    merged = {}
    with torch.no_grad():
        for path, module in _wrapped(model):
            w = module.base_layer.weight
            delta = (module.lora_B.weight.float() @ module.lora_A.weight.float()) * module.scaling
            merged[f"{path}.weight"] = w + delta.to(w.dtype)
    out = []
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out.append((plain, merged.get(plain, param.detach())))
    return out


def nbytes(tensors: list[tuple[str, Any]], dtype_bytes: int | None = None) -> int:
    """Bytes of ``tensors`` (as held, or at ``dtype_bytes`` per element: what the wire carries in the engine's dtype)."""
    return sum(t.numel() * (dtype_bytes or t.element_size()) for _, t in tensors)
