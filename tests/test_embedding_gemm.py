"""Which input embeddings the bridge's reload leaves without a CPU matmul handle (inference_side/reload_hooks.py
``lookup_only_embeddings``, ``EmbeddingGemm``), on real torch module trees. The classes below stand in for vLLM's
``VocabParallelEmbedding`` and ``ParallelLMHead`` (the real ones need a tensor-parallel group to be built; the
selection goes by class name, as vLLM's own layer names are what it matches). The engine-level check (a real
Qwen2 engine whose input embedding gets no handle and still equals a cold-loaded one) is in
tests/test_delta_sync.py."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class WithLoRA(torch.nn.Module):
    """Stands for vLLM's LoRA wrapper: not an embedding class itself, the wrapped layer is."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base


def untied() -> tuple[torch.nn.Module, set[str]]:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = VocabParallelEmbedding()
    model.lm_head = ParallelLMHead()
    return model, {"model.embed_tokens"}


def tied_by_module() -> tuple[torch.nn.Module, set[str]]:
    """Qwen2 with ``tie_word_embeddings``: ``lm_head.tie_weights`` returns the embedding, so it is the head."""
    model, _ = untied()
    model.lm_head = model.model.embed_tokens
    return model, set()


def logits_from_embedding() -> tuple[torch.nn.Module, set[str]]:
    """gemma2, commandr: no head of their own; ``compute_logits`` multiplies by the input embedding."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = VocabParallelEmbedding()
    return model, set()


def head_sharing_the_embeddings_weight() -> tuple[torch.nn.Module, set[str]]:
    """A head tied by its parameter (vLLM's ``tie_weights`` for GGUF): the head builds its own handle."""
    model, want = untied()
    model.lm_head.weight = model.model.embed_tokens.weight
    return model, want


def embedding_under_two_names() -> tuple[torch.nn.Module, set[str]]:
    model, _ = untied()
    model.shared = model.model.embed_tokens
    return model, set()


def two_embeddings_and_a_head() -> tuple[torch.nn.Module, set[str]]:
    model, _ = untied()
    model.model.position_table = VocabParallelEmbedding()
    return model, {"model.embed_tokens", "model.position_table"}


def wrapped_for_lora() -> tuple[torch.nn.Module, set[str]]:
    model, _ = untied()
    model.model.embed_tokens = WithLoRA(VocabParallelEmbedding())
    model.lm_head = WithLoRA(ParallelLMHead())
    return model, {"model.embed_tokens.base_layer"}


@pytest.mark.parametrize("build", [untied, tied_by_module, logits_from_embedding, head_sharing_the_embeddings_weight,
                                   embedding_under_two_names, two_embeddings_and_a_head, wrapped_for_lora],
                         ids=lambda f: f.__name__.replace("_", " "))
def test_an_embedding_is_lookup_only_unless_it_is_a_head_or_the_model_has_none(build: Any) -> None:
    from inference_side.reload_hooks import lookup_only_embeddings

    model, want = build()
    ids = lookup_only_embeddings(model)
    got = {name for name, module in model.named_modules() if id(module) in ids}
    assert got == want


def test_during_an_update_a_lookup_only_embedding_gets_plain_linear_and_the_rest_vllms_step() -> None:
    from inference_side.reload_hooks import EmbeddingGemm

    model, _ = untied()
    embed, head = model.model.embed_tokens, model.lm_head
    embed.cpu_linear = head.cpu_linear = "the cold load's handle"
    calls: list[torch.nn.Module] = []

    def vllms_step(method: object, layer: torch.nn.Module) -> None:
        calls.append(layer)
        layer.cpu_linear = "a new handle"

    gemm = EmbeddingGemm()
    gemm.process(vllms_step, None, embed)  # not during an update (vLLM's own reload_weights): vLLM's step
    assert calls == [embed] and embed.cpu_linear == "a new handle"
    gemm.start(model)
    gemm.process(vllms_step, None, embed)
    gemm.process(vllms_step, None, head)
    assert calls == [embed, head] and gemm.skipped == 1
    # what vLLM sets where it builds no handle: a matmul on the current weight, never the old packed copy
    assert embed.cpu_linear is torch.nn.functional.linear and head.cpu_linear == "a new handle"
    gemm.active = False  # the update ended (ReloadSession.finish, abort): vLLM's own reload that follows builds it
    gemm.process(vllms_step, None, embed)
    assert calls == [embed, head, embed] and embed.cpu_linear == "a new handle"
    gemm.start(model)  # the next update counts from zero
    assert gemm.skipped == 0
    embed.weight = torch.nn.Parameter(torch.zeros(8, 4, device="meta"), requires_grad=False)  # not on CPU (a GPU)
    gemm.process(vllms_step, None, embed)  # vLLM's step, which builds no handle off CPU
    assert calls == [embed, head, embed, embed] and gemm.skipped == 0
