"""A plain vLLM engine cold-loaded from a checkpoint, with no weight-bridge code in it.

The reference every update is compared against: ``python -m devtools.coldload --model DIR --tp 1
--dtype bfloat16 --prompts '[[1,2,3]]'`` prints ``COLD {json}`` (greedy tokens and per-token logprobs
per model) on its last line. Run as its own process: vLLM spawns workers and needs the main guard.

``ColdLoader`` keeps one such process (``--serve``) for many cold loads: each request builds a fresh engine from
the checkpoint, as the one-shot command does, without a new process and vLLM import each time (tests ask for
a cold load two dozen times a run).
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


class ColdLoader:
    """One ``python -m devtools.coldload --serve`` process at TP size ``tp`` (the thread binding a TP size needs
    is set once per process), started on the first request. ``outputs`` and ``lora_outputs`` answer as
    ``cold_outputs`` and ``cold_lora_outputs`` do, each from engines it builds for that request. Every request
    has a deadline (``timeout_s``); a request that fails or times out raises ``ColdLoadError`` with the
    process's last log lines, and the process is stopped (the next request starts a new one). ``close`` stops it."""

    def __init__(self, tp: int, env: dict[str, str] | None = None, log_dir: str | None = None) -> None:
        self.tp = tp
        self.env = env
        self.log_dir = log_dir
        self.proc: subprocess.Popen[str] | None = None
        self.log_path = ""
        self.lines: Any = None

    def outputs(self, models: list[str], dtype: str, prompts: list[list[int]], max_tokens: int = 8,
                timeout_s: float = 900) -> dict[str, list[dict[str, Any]]]:
        return self._ask({"models": models, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens}, timeout_s)

    def lora_outputs(self, model: str, loras: list[str], dtype: str, prompts: list[list[int]], max_lora_rank: int = 8,
                     max_loras: int = 2, max_tokens: int = 8, timeout_s: float = 900) -> dict[str, list[dict[str, Any]]]:
        return self._ask({"models": [model], "loras": loras, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
                          "max_lora_rank": max_lora_rank, "max_loras": max_loras}, timeout_s)

    def _start(self) -> None:
        import queue
        import tempfile
        import threading

        fd, self.log_path = tempfile.mkstemp(prefix=f"coldload-tp{self.tp}-", suffix=".log", dir=self.log_dir)
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "devtools.coldload", "--serve", "--tp", str(self.tp)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=self.env, bufsize=1)
        lines: queue.Queue[str | None] = queue.Queue()
        out = self.proc.stdout

        def pump() -> None:
            assert out is not None
            for line in out:
                lines.put(line)
            lines.put(None)  # the process closed its output: it ended

        threading.Thread(target=pump, name="coldload-out", daemon=True).start()
        self.lines = lines

    def _ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
        import queue
        import time

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            self._fail(f"could not send the request: {exc}")
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer within {timeout_s:.0f} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self._fail(f"the process ended (rc={self.proc.wait(30)})")
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK):])
                if "error" in answer:
                    self._fail(answer["error"])
                result: dict[str, list[dict[str, Any]]] = answer["outputs"]
                return result

    def _fail(self, why: str) -> None:
        tail = ""
        if self.log_path:
            with open(self.log_path, errors="replace") as log:
                tail = log.read()[-2000:]
        self.close(keep_log=True)
        raise ColdLoadError(f"cold-load process (TP {self.tp}): {why}; its log ({self.log_path}) ends:\n{tail}")

    def close(self, keep_log: bool = False) -> None:
        """Stop the process (end of input, then SIGKILL after 30 s) and remove its log unless ``keep_log``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(30)
        if not keep_log and self.log_path:
            os.unlink(self.log_path)
            self.log_path = ""


def _serve(tp: int, requests: Any, answers: Any) -> None:
    """``--serve``: one JSON request per input line (``models``, ``dtype``, ``prompts``, ``max_tokens``, and for
    LoRA ``loras``, ``max_lora_rank``, ``max_loras``), answered by one line ``MARK {"outputs": ...}`` (or
    ``MARK {"error": ...}``) from engines built for it, until the input ends."""
    for line in requests:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            outputs = _run(req["models"], tp, req["dtype"], req["prompts"], req["max_tokens"], req.get("loras"),
                           req.get("max_lora_rank", 8), req.get("max_loras", 2))
            answer: dict[str, Any] = {"outputs": outputs}
        except Exception as exc:  # noqa: BLE001 - answered, and the process serves the next request
            import traceback

            traceback.print_exc()
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(MARK + json.dumps(answer) + "\n")
        answers.flush()


def _outputs(outs: Any) -> list[dict[str, Any]]:
    return [{"token_ids": list(o.outputs[0].token_ids),
             "logprobs": [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)
                          if s is not None]}
            for o in outs]


def _run(models: list[str], tp: int, dtype: str, prompts: list[list[int]], max_tokens: int,
         loras: list[str] | None = None, max_lora_rank: int = 8, max_loras: int = 2) -> dict[str, Any]:
    import gc

    from bridge.cores import cpu_engine_env

    cpu_engine_env(tp, os.environ)
    # vLLM's engine core in this process rather than in one it spawns per engine: a cold load of the
    # same weights with the same kernels (outputs identical, TP 1 and 2), without a fresh process and
    # vLLM import per checkpoint
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
        del llm
        gc.collect()
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
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--serve", action="store_true", help="answer JSON requests read from stdin, one per line")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", help="JSON list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lora", action="append", default=[], help="a PEFT adapter directory (one --model; LoRA enabled)")
    p.add_argument("--max-lora-rank", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=2)
    a = p.parse_args(argv)
    if a.serve:
        # answers alone on the pipe: this process's logs and those of the workers it spawns go to stderr
        answers = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(2, 1)
        _serve(a.tp, sys.stdin, answers)
        return 0
    if not a.model or a.prompts is None:
        p.error("--model and --prompts are required (or --serve)")
    if a.lora and len(a.model) != 1:
        p.error("--lora takes exactly one --model")
    print(MARK + json.dumps(_run(a.model, a.tp, a.dtype, json.loads(a.prompts), a.max_tokens, a.lora, a.max_lora_rank,
                                 a.max_loras)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
