"""The oracle: a plain vLLM engine cold-loaded from a checkpoint (no weight-bridge code in it).

``python tests/oracle.py --model DIR --tp 1 --dtype bfloat16 --prompts '[[1,2,3]]'`` prints the greedy
tokens and per-token logprobs as JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
import os

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=8)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(a.tp)))
    from vllm import LLM, SamplingParams

    prompts = json.loads(a.prompts)
    results = {}
    for model in a.model:
        llm = LLM(model=model, tensor_parallel_size=a.tp, dtype=a.dtype, skip_tokenizer_init=True,
                  max_model_len=256, max_num_seqs=8, enforce_eager=True)
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                            SamplingParams(max_tokens=a.max_tokens, temperature=0.0, logprobs=1, detokenize=False),
                            use_tqdm=False)
        results[model] = [{"token_ids": list(o.outputs[0].token_ids),
                           "logprobs": [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]}
                          for o in outs]
        del llm
        import gc

        gc.collect()
    print("ORACLE " + json.dumps(results), flush=True)
