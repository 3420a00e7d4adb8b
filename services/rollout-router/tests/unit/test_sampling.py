"""Protected sampling and request checks, without an engine."""

from __future__ import annotations

import pytest

from molt.core.errors import InvalidInput
from molt.core.rollout import RolloutSettings
from molt.router.config import SamplingSettings
from molt.router.sampling import FROM_ROLLOUT, ModelLimits, RequestedSampling, check_prompt, resolve

LIMITS = ModelLimits(vocab_size=320, max_model_len=100)
CONFIG = SamplingSettings(max_tokens_default=16, max_tokens_cap=64)
ROLLOUT = RolloutSettings(temperature=0.8, top_p=1.0)  # temperature, top_p and top_k: the shared [rollout] table


def test_protected_values_come_from_config() -> None:
    resolved = resolve(RequestedSampling(max_tokens=10, seed=3, sample_count=2), CONFIG, ROLLOUT, 5, LIMITS)
    s = resolved.sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.seed, s.sample_count) == (0.8, 1.0, 10, 3, 2)
    assert resolve(RequestedSampling(), CONFIG, ROLLOUT, 5, LIMITS).sampling.max_tokens == 16  # default
    assert resolve(RequestedSampling(temperature=0.8), CONFIG, ROLLOUT, 5, LIMITS).ignored == ()  # same value is fine


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "min_p", "repetition_penalty"])
def test_override_rejected_or_ignored(field: str) -> None:
    value = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}[field]
    requested = RequestedSampling(**{field: value})
    with pytest.raises(InvalidInput, match=f"sampling_params.{field} is protected") as info:
        resolve(requested, CONFIG, ROLLOUT, 5, LIMITS)
    assert info.value.reason == "PROTECTED_SAMPLING_OVERRIDE"
    lenient = CONFIG.model_copy(update={"on_protected_override": "ignore"})
    resolved = resolve(requested, lenient, ROLLOUT, 5, LIMITS)
    assert resolved.ignored == (field,)
    assert getattr(resolved.sampling, field) == getattr(ROLLOUT if field in FROM_ROLLOUT else CONFIG, field)


def test_max_tokens_cap_and_context() -> None:
    with pytest.raises(InvalidInput, match=r"max_tokens 65 is outside \[0, 64\]"):
        resolve(RequestedSampling(max_tokens=65), CONFIG, ROLLOUT, 5, LIMITS)
    # The budget is cut to what the context leaves; the sample then ends with LENGTH.
    assert resolve(RequestedSampling(max_tokens=64), CONFIG, ROLLOUT, 90, LIMITS).sampling.max_tokens == 10


def test_prompt_checks() -> None:
    check_prompt("r", [0, 319], LIMITS)
    for prompt, reason in (
        ([], "EMPTY_PROMPT"),
        ([1, 320], "TOKEN_OUT_OF_VOCAB"),
        ([-1], "TOKEN_OUT_OF_VOCAB"),
        ([1] * 100, "PROMPT_TOO_LONG"),
    ):
        with pytest.raises(InvalidInput) as info:
            check_prompt("r", prompt, LIMITS)
        assert info.value.reason == reason
    with pytest.raises(InvalidInput, match="request_id"):
        check_prompt("", [1], LIMITS)


def test_other_sampling_bounds() -> None:
    for requested, words in (
        (RequestedSampling(sample_count=65), "sample_count"),
        (RequestedSampling(top_logprob_count=21), "top_logprob_count"),
        (RequestedSampling(stop_token_ids=(400,)), "stop_token_ids"),
        (RequestedSampling(stop_strings=("",)), "stop_strings"),
    ):
        with pytest.raises(InvalidInput, match=words):
            resolve(requested, CONFIG, ROLLOUT, 5, LIMITS)
