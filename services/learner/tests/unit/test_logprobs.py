"""The logprob head: log-softmax, the picked token and the entropy against float64 by hand, with gradients."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from molt.algos.checks import deferred_checks
from molt.learner.logprobs import next_token_logprobs, token_logprobs
from molt.learner.models import load_policy
from molt.learner.packing import pack, pad

F64 = torch.float64


def by_hand(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.to(F64) / temperature, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_equals_float64_values_and_gradients(dtype: torch.dtype) -> None:
    """Values and gradients of ``sum(logprob * a) + sum(H * b)`` (entropy_grad) equal float64 autograd."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 50, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, 50, (37,), generator=generator)
    a, b = torch.randn(37, generator=generator), torch.randn(37, generator=generator)
    ours_in = logits.clone().requires_grad_(True)
    picked, entropy = next_token_logprobs(ours_in, targets, 0.7, True, True)
    assert picked.dtype == entropy.dtype == torch.float32  # type: ignore[union-attr]
    ((picked * a).sum() + (entropy * b).sum()).backward()  # type: ignore[operator]
    ref_in = logits.to(F64).requires_grad_(True)
    ref_picked, ref_entropy = by_hand(ref_in, targets, 0.7)
    ((ref_picked * a.to(F64)).sum() + (ref_entropy * b.to(F64)).sum()).backward()
    torch.testing.assert_close(picked.to(F64), ref_picked.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy.to(F64), ref_entropy.detach(), rtol=0, atol=2e-5)  # type: ignore[union-attr]
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient lands in the logits' dtype
    torch.testing.assert_close(ours_in.grad.to(F64), ref_in.grad, rtol=0, atol=tolerance)  # type: ignore[union-attr]


def test_a_logged_entropy_carries_no_gradient() -> None:
    logits = torch.randn(4, 9, requires_grad=True)
    picked, entropy = next_token_logprobs(logits, torch.tensor([0, 1, 2, 3]), 1.0, True, False)
    assert picked.requires_grad and entropy is not None and not entropy.requires_grad
    assert next_token_logprobs(logits, torch.tensor([0, 1, 2, 3]), 1.0, False, False)[1] is None


@pytest.mark.parametrize("layout", [pack, pad])
def test_token_entropy_on_the_grid_equals_each_sequence_by_hand(tiny_model: Path, layout: Callable) -> None:
    """Four sequences in one micro-batch (one of a single token: it predicts nothing): each row's
    entropies (and logprobs) are those of the sequence alone by hand, and the grid holds 0 past each
    sequence's predictions."""
    model = load_policy(tiny_model, torch.device("cpu"), trainable=False)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 320, (n,), generator=generator) for n in (9, 1, 4, 13)]
    logprobs, entropy = token_logprobs(model, layout(sequences), 4, 0.8, entropy=True)
    assert entropy is not None and entropy.shape == logprobs.shape == (4, 12)
    for i, seq in enumerate(sequences):
        with torch.no_grad():
            logits = model(input_ids=seq[None]).logits[0, :-1]
        want_logprobs, want_entropy = by_hand(logits, seq[1:], 0.8)  # empty for the single token
        n = seq.numel() - 1
        torch.testing.assert_close(entropy[i, :n].to(F64), want_entropy, rtol=0, atol=2e-5)
        torch.testing.assert_close(logprobs[i, :n].to(F64), want_logprobs, rtol=0, atol=2e-5)
        assert not entropy[i, n:].any() and not logprobs[i, n:].any()


def test_a_non_finite_entropy_is_a_clear_error(tiny_model: Path) -> None:
    """A NaN in one vocabulary row of the head poisons every distribution: the entropy check names it."""
    model = load_policy(tiny_model, torch.device("cpu"), trainable=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[7, 0] = float("nan")
    with pytest.raises(ValueError, match=r"entropy contains NaN at index \(0, 0\)"):
        token_logprobs(model, pad([torch.arange(5)]), 1, 1.0, entropy=True)
    reached_the_end = False
    with pytest.raises(ValueError, match=r"entropy contains NaN at index \(0, 0\)"), deferred_checks():
        token_logprobs(model, pad([torch.arange(5)]), 1, 1.0, entropy=True)  # in a step: raised at its end
        reached_the_end = True
    assert reached_the_end
