"""The trainer's half of the parity probe: its own log-probabilities of a fixed set of token sequences.

After every sync the engine scores the same sequences with the weights it now serves and compares
(``InferenceServer._probe``): the mean absolute log-prob difference and a KL estimate land in the
sync record, and a difference beyond ``probe.max_mean_abs_logprob_diff`` flags the sync.

The trainer side is computed in float32 with the trainer's own (transformers) model, so the number
measures what RL practitioners call the train/inference mismatch: bf16 weights, kernels and numerics
of the engine against the trainer's reference forward pass.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from bridge import wire
from bridge.errors import BridgeError

DEFAULT_SEED = 20240611
DEFAULT_COUNT = 4
DEFAULT_LENGTH = 24


class ProbeError(BridgeError):
    """The probe cannot be built as asked (empty or too short sequences, token ids outside the vocabulary)."""


def probe_sequences(vocab_size: int, count: int = DEFAULT_COUNT, length: int = DEFAULT_LENGTH,
                    seed: int = DEFAULT_SEED) -> tuple[tuple[int, ...], ...]:
    """``count`` fixed pseudo-random token sequences of ``length`` ids in ``[1, vocab_size)``.

    The same arguments give the same sequences in every process (a seeded torch generator).
    """
    import torch

    if count < 1 or length < 2:
        raise ProbeError(f"probe needs at least one sequence of at least 2 tokens (got {count} x {length})")
    if vocab_size < 2:
        raise ProbeError(f"vocabulary of {vocab_size} tokens is too small for a probe")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (count, length), generator=gen)
    return tuple(tuple(int(t) for t in row) for row in ids)


def trainer_logprobs(model: Any, sequences: Sequence[Sequence[int]]) -> tuple[tuple[float, ...], ...]:
    """log p(token_i | tokens_<i) for every token after the first, from a float32 forward pass.

    ``model`` is a transformers causal LM; a model in another dtype is scored through a float32 copy
    (its weights are unchanged by the cast, so the copy holds exactly the values being published).
    """
    import torch

    if not sequences:
        raise ProbeError("probe has no sequences")
    vocab = int(model.config.vocab_size)
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ProbeError(f"probe sequence {i} has {len(seq)} token(s); at least 2 are needed")
        bad = [t for t in seq if not 0 <= int(t) < vocab]
        if bad:
            raise ProbeError(f"probe sequence {i}: token ids {bad[:5]} outside the vocabulary of {vocab}")
    scorer = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = scorer.training
    scorer.eval()
    out: list[tuple[float, ...]] = []
    try:
        with torch.no_grad():
            for seq in sequences:  # one at a time: sequences may differ in length, no padding games
                ids = torch.tensor([list(seq)], dtype=torch.long)
                logits = scorer(input_ids=ids).logits.float()
                logp = torch.log_softmax(logits[0, :-1], dim=-1)
                picked = logp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
                out.append(tuple(float(x) for x in picked))
    finally:
        if was_training:
            scorer.train()
    return tuple(out)


def build_probe(model: Any, sequences: Sequence[Sequence[int]] | None = None) -> wire.ProbeSpec:
    """A ``wire.ProbeSpec`` for ``model``: the default probe sequences unless given, with its logprobs."""
    seqs = tuple(tuple(int(t) for t in s) for s in sequences) if sequences is not None \
        else probe_sequences(int(model.config.vocab_size))
    return wire.ProbeSpec(sequences=seqs, logprobs=trainer_logprobs(model, seqs))
