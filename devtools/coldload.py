"""A plain vLLM engine cold-loaded from a checkpoint, with no weight-bridge code in it.

The reference every update is compared against: ``python -m devtools.coldload --model DIR --tp 1
--dtype bfloat16 --prompts '[[1,2,3]]'`` prints ``COLD {json}`` (greedy tokens and per-token logprobs
per model) on its last line. Run as its own process: vLLM spawns workers and needs the main guard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from bridge.errors import BridgeError

MARK = "COLD "


class ColdLoadError(BridgeError):
    """The reference engine could not be started or produced no output."""


def cold_outputs(models: list[str], tp: int, dtype: str, prompts: list[list[int]], max_tokens: int = 8,
                 env: dict[str, str] | None = None, timeout_s: float = 900) -> dict[str, list[dict[str, Any]]]:
    """Greedy outputs of an engine cold-loaded from each model directory (one subprocess for all)."""
    cmd = [sys.executable, "-m", "devtools.coldload", "--tp", str(tp), "--dtype", dtype,
           "--prompts", json.dumps(prompts), "--max-tokens", str(max_tokens)]
    for m in models:
        cmd += ["--model", m]
    return _run_oracle(cmd, env, timeout_s, "cold-loaded engine")


def cold_lora_outputs(model: str, loras: list[str], tp: int, dtype: str, prompts: list[list[int]], max_lora_rank: int = 8,
                      max_loras: int = 2, max_tokens: int = 8, env: dict[str, str] | None = None,
                      timeout_s: float = 900) -> dict[str, list[dict[str, Any]]]:
    """Greedy outputs of one engine cold-loaded from ``model`` with LoRA enabled: under ``"base"`` without an
    adapter, under each PEFT directory of ``loras`` with that adapter, loaded by vLLM itself (``LoRARequest``)."""
    cmd = [sys.executable, "-m", "devtools.coldload", "--tp", str(tp), "--dtype", dtype, "--model", model,
           "--prompts", json.dumps(prompts), "--max-tokens", str(max_tokens), "--max-lora-rank", str(max_lora_rank),
           "--max-loras", str(max_loras)]
    for lora in loras:
        cmd += ["--lora", lora]
    return _run_oracle(cmd, env, timeout_s, "cold-loaded LoRA engine")


def _run_oracle(cmd: list[str], env: dict[str, str] | None, timeout_s: float, what: str) -> dict[str, list[dict[str, Any]]]:
    """Run one cold-load subprocess; the outputs it printed after ``MARK``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        raise ColdLoadError(f"{what} failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, list[dict[str, Any]]] = json.loads(line[len(MARK):])
    return result


def _outputs(outs: Any) -> list[dict[str, Any]]:
    return [{"token_ids": list(o.outputs[0].token_ids),
             "logprobs": [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)
                          if s is not None]}
            for o in outs]


def _run(models: list[str], tp: int, dtype: str, prompts: list[list[int]], max_tokens: int,
         loras: list[str] | None = None, max_lora_rank: int = 8, max_loras: int = 2) -> dict[str, Any]:
    import gc

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's engine core in this process rather than in one it spawns per engine: a cold load of the
    # same weights with the same kernels (outputs identical, TP 1 and 2), without a fresh process and
    # vLLM import per checkpoint
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, detokenize=False)
    inputs: Any = [{"prompt_token_ids": q} for q in prompts]
    results = {}
    if loras:
        from vllm.lora.request import LoRARequest

        (model,) = models
        llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, skip_tokenizer_init=True,  # type: ignore[arg-type]
                  max_model_len=256, max_num_seqs=8, enforce_eager=True, enable_lora=True,
                  max_lora_rank=max_lora_rank, max_loras=max_loras)  # type: ignore[arg-type]
        results["base"] = _outputs(llm.generate(inputs, params, use_tqdm=False))
        for i, lora in enumerate(loras, start=1):
            request = LoRARequest(lora_name=f"cold-{i}", lora_int_id=i, lora_path=lora)
            results[lora] = _outputs(llm.generate(inputs, params, use_tqdm=False, lora_request=request))
        return results
    for model in models:
        llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, skip_tokenizer_init=True,  # type: ignore[arg-type]
                  max_model_len=256, max_num_seqs=8, enforce_eager=True)
        results[model] = _outputs(llm.generate(inputs, params, use_tqdm=False))
        del llm
        gc.collect()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="devtools.coldload", description=__doc__)
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lora", action="append", default=[], help="a PEFT adapter directory (one --model; LoRA enabled)")
    p.add_argument("--max-lora-rank", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=2)
    a = p.parse_args(argv)
    if a.lora and len(a.model) != 1:
        p.error("--lora takes exactly one --model")
    print(MARK + json.dumps(_run(a.model, a.tp, a.dtype, json.loads(a.prompts), a.max_tokens, a.lora, a.max_lora_rank,
                                 a.max_loras)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
