"""TRL's ``GRPOTrainer`` in server mode, its weights taken to ``vllm serve`` through weight-bridge (on CPU).

Starts ``vllm serve`` with the ``weight_bridge`` backend on a tiny random Qwen2 (word-level tokenizer: tokens
``t0 .. t511``), then trains a few GRPO steps against a toy reward (the share of even-numbered tokens in a
completion). TRL syncs the policy before each generation; each sync is one weight-bridge version. Per step it
prints the version TRL synced, the version the server reports (``/weight_info``) and whether the server's
greedy answer to a fixed prompt changed since the previous step (not at step 1: TRL's first sync, version
1, carries the starting weights)::

    python examples/trl_grpo.py --steps 3

The only weight-bridge line in the training code is ``with use_weight_bridge(...)`` around the trainer's
construction (trainer_side/trl.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

PROBE = [1, 2, 3, 4, 5]


def make_checkpoint(directory: Path, seed: int = 1) -> Path:
    """A tiny Qwen2 (bfloat16) with a word-level tokenizer beside it."""
    from devtools.tiny_models import build_model, save_checkpoint, save_word_tokenizer

    model = build_model("tiny", seed=seed)
    ckpt = save_checkpoint(model, directory)
    save_word_tokenizer(ckpt, model.config.vocab_size)
    return ckpt


def even_share(completions: list[str], **_: Any) -> list[float]:
    """Toy verifiable reward: the share of the completion's tokens ``tN`` with an even N."""
    out = []
    for text in completions:
        ids = [int(n) for n in re.findall(r"t(\d+)", text)]
        out.append(sum(1 for i in ids if i % 2 == 0) / len(ids) if ids else 0.0)
    return out


def build_trainer(url: str, ckpt: Path, out_dir: Path, steps: int, base_port: int, lr: float = 1e-2,
                  callbacks: list[Any] | None = None) -> Any:
    """A ``GRPOTrainer`` (server mode, CPU, float32 policy) whose weight sync goes through weight-bridge."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from trainer_side.trl import use_weight_bridge
    from trainer_side.vllm_backend import WeightBridgeInitInfo

    # the word-level tokenizer itself (AutoTokenizer would pick Qwen2's class by the model type)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    tokenizer.pad_token = "t0"
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    prompts = [" ".join(f"t{(7 * i + j) % 500 + 10}" for j in range(4)) for i in range(64)]
    args = GRPOConfig(
        output_dir=str(out_dir), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=steps,
        learning_rate=lr, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        seed=0, dataloader_num_workers=0)
    with use_weight_bridge(WeightBridgeInitInfo(rank=0, base_port=base_port)):
        return GRPOTrainer(model=model, reward_funcs=even_share, args=args, processing_class=tokenizer,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=callbacks)


def served_answer(url: str, model: str, prompt: list[int] = PROBE, max_tokens: int = 8) -> dict[str, Any]:
    """The server's greedy completion of ``prompt``: token ids and their logprobs."""
    import requests

    r = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def step_reporter(url: str, model: str) -> Any:
    """A TrainerCallback printing one JSON line per step: the version TRL synced before the step's
    generation (set ``.client`` to the trainer's ``vllm_generation.vllm_client``), the version the server
    names, and whether its greedy answer changed since the previous step."""
    import requests
    from transformers import TrainerCallback

    class StepReport(TrainerCallback):
        def __init__(self) -> None:
            self.client: Any = None
            self.lines: list[dict[str, Any]] = []
            self._last = served_answer(url, model)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            answer = served_answer(url, model)
            line = {"step": state.global_step, "synced_version": self.client.engine.version,
                    "served_version": requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"],
                    "served_output_changed": answer != self._last}
            self._last = answer
            self.lines.append(line)
            print(json.dumps(line), flush=True)

    return StepReport()


def main(argv: list[str] | None = None) -> int:
    from devtools.serve import served

    p = argparse.ArgumentParser(prog="examples/trl_grpo.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--port", type=int, default=8000, help="vllm serve's HTTP port")
    p.add_argument("--base-port", type=int, default=47310, help="the workers' weight-bridge receivers: base_port + TP rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--workdir", type=Path, default=None, help="checkpoint, server log, trainer output (default: a temp dir)")
    a = p.parse_args(argv)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="wb-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(work / "ckpt")
    # processed_logprobs: what TRL's importance-sampling correction expects from the server
    with served(ckpt, a.port, work / "server.log", extra=("--logprobs-mode", "processed_logprobs")) as url:
        report = step_reporter(url, str(ckpt))
        trainer = build_trainer(url, ckpt, work / "out", a.steps, a.base_port, a.lr, callbacks=[report])
        report.client = trainer.vllm_generation.vllm_client
        trainer.train()
        client = trainer.vllm_generation.vllm_client
        print(json.dumps({"done": True, "steps": trainer.state.global_step, "last_version": client.engine.version,
                          "served_version": report.lines[-1]["served_version"] if report.lines else None}), flush=True)
        client.close_communicator()
    return 0


if __name__ == "__main__":
    sys.exit(main())
