"""GRPO on a toy verifiable reward, with rollouts from a vLLM engine that weight-bridge keeps current.

The loop itself is ``apps/grpo_toy.py`` (installed with the package, so the Ray job ``python -m
apps.ray_job --loop grpo`` runs it too); this script runs it on a laptop CPU:

    python examples/grpo_toy.py --steps 30
    python examples/grpo_toy.py --steps 32 --lora 8    # trains a LoRA adapter, syncs only the adapter
    torchrun --nproc-per-node 2 examples/grpo_toy.py --trainer-ranks 2 --steps 12   # FSDP2 over 2 ranks

``python examples/grpo_toy.py --help`` lists the options.
"""

from __future__ import annotations

import sys

from apps.grpo_toy import main

if __name__ == "__main__":
    sys.exit(main())
