"""Trainer-side probe and GRPO pieces without an engine: fixed sequences, float32 scoring, clear errors,
the GRPO example's reward, advantages and the alignment of its per-token log-probabilities."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bridge import wire


@pytest.fixture(scope="module")
def model() -> Any:
    from devtools.tiny_models import build_model

    return build_model("tiny", 2)  # bfloat16, as build_model returns it


def test_probe_sequences_are_fixed_and_in_vocab() -> None:
    from trainer_side.probe import probe_sequences

    a, b = probe_sequences(512), probe_sequences(512)
    assert a == b and len(a) == 4 and all(len(s) == 24 for s in a)
    assert all(1 <= t < 512 for s in a for t in s)
    assert probe_sequences(512, seed=1) != a


def test_trainer_logprobs_are_float32_of_the_same_weights(model: Any) -> None:
    """A bf16 model is scored through a float32 copy: same numbers as scoring model.float() directly,
    the model itself stays bf16, and every value is a log-probability."""
    import copy

    import torch

    from trainer_side.probe import probe_sequences, trainer_logprobs

    seqs = probe_sequences(512, count=2, length=10)
    got = trainer_logprobs(model, seqs)
    want = trainer_logprobs(copy.deepcopy(model).float(), seqs)
    assert got == want
    assert next(model.parameters()).dtype == torch.bfloat16
    assert [len(x) for x in got] == [9, 9]
    assert all(x < 0 and math.isfinite(x) for row in got for x in row)
    # Each value is log p(token_i | prefix): it matches a direct forward pass on the prefix alone.
    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([list(seqs[0][:5])])).logits[0, -1].float()
    assert torch.log_softmax(logits, -1)[seqs[0][5]].item() == pytest.approx(got[0][4], abs=1e-5)


def test_build_probe_round_trips_the_wire(model: Any) -> None:
    from trainer_side.probe import build_probe

    probe = build_probe(model)
    assert wire.ProbeSpec.from_wire(probe.to_wire()) == probe


@pytest.mark.parametrize(("sequences", "message"), [
    ([], "probe has no sequences"),
    ([[5]], "probe sequence 0 has 1 token(s); at least 2 are needed"),
    ([[1, 2], [3, 900]], "probe sequence 1: token ids [900] outside the vocabulary of 512"),
])
def test_bad_probe_input_is_named(model: Any, sequences: list[list[int]], message: str) -> None:
    from trainer_side.probe import ProbeError, trainer_logprobs

    with pytest.raises(ProbeError) as info:
        trainer_logprobs(model, sequences)
    assert message in str(info.value)


def test_grpo_reward_and_group_advantages() -> None:
    from apps.grpo_toy import group_advantages, reward

    assert reward([1, 63, 64, 500], 64) == 0.5 and reward([], 64) == 0.0
    adv = group_advantages([0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2], group=4)
    first, second = adv[:4], adv[4:]
    assert sum(first) == pytest.approx(0.0, abs=1e-9) and adv[1] > adv[2] > adv[0]
    assert math.sqrt(sum(a * a for a in first) / 4) == pytest.approx(1.0, abs=1e-3)
    assert second == [0.0] * 4  # a group with equal rewards teaches nothing


def test_grpo_completion_logprobs_align_with_probe_scoring(model: Any) -> None:
    """The GRPO loss uses log p of exactly the sampled completion tokens: the same numbers the probe's
    float32 scoring gives for those positions of the full sequence."""
    import copy

    import torch

    from apps.grpo_toy import completion_logprobs
    from trainer_side.probe import trainer_logprobs

    policy = copy.deepcopy(model).float()
    prompts = [[10, 20, 30], [7, 8, 9, 11, 12]]
    completions = [[100, 101, 102, 103], [200, 201]]
    with torch.no_grad():
        lp, mask = completion_logprobs(policy, prompts, completions)
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        full = trainer_logprobs(policy, [p + c])[0]
        assert lp[row, :len(c)].tolist() == pytest.approx(list(full[len(p) - 1:]), abs=1e-5)
