"""Request checks and protected sampling: what a client may ask for, resolved against the router's config.

The protected settings come from the config: temperature, top_p and top_k from the
shared ``[rollout]`` table (the learner must know them), min_p and repetition_penalty
from ``[router.sampling]``; a request that sets one to another value is
refused (or, with ``on_protected_override = "ignore"``, the value is ignored
and counted). Everything here is pure so it is tested without an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from molt.core.errors import InvalidInput
from molt.core.rollout import RolloutSettings
from molt.router.config import SamplingSettings

PROTECTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FROM_ROLLOUT = ("temperature", "top_p", "top_k")  # the learner divides by / checks these too
MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 64
MAX_REQUEST_ID = 128


@dataclass(frozen=True)
class RequestedSampling:
    """Sampling fields as a client sent them; None = not set."""

    max_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    sample_count: int = 0
    top_logprob_count: int = 0


@dataclass(frozen=True)
class Sampling:
    """Resolved sampling settings of one request, as the engine receives them."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    sample_count: int = 1
    top_logprob_count: int = 0


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts."""

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Resolved:
    """A checked request: its sampling and the protected fields that were ignored."""

    sampling: Sampling
    ignored: tuple[str, ...] = field(default=())


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def check_prompt(request_id: str, prompt_token_ids: list[int], limits: ModelLimits) -> None:
    """Refuses an empty or over-long prompt, out-of-vocabulary ids and a bad request id."""
    if not 1 <= len(request_id) <= MAX_REQUEST_ID:
        raise InvalidInput(
            f"request_id must have 1..{MAX_REQUEST_ID} characters, got {len(request_id)}", reason="BAD_REQUEST_ID"
        )
    if not prompt_token_ids:
        raise InvalidInput("prompt_token_ids is empty", reason="EMPTY_PROMPT")
    if len(prompt_token_ids) >= limits.max_model_len:
        raise InvalidInput(
            f"prompt has {len(prompt_token_ids)} tokens; the model's context is {limits.max_model_len} "
            "(prompt + at least one generated token must fit)",
            reason="PROMPT_TOO_LONG",
        )
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= limits.vocab_size:
        bad = low if low < 0 else high
        raise InvalidInput(
            f"prompt token id {bad} is outside the vocabulary [0, {limits.vocab_size})", reason="TOKEN_OUT_OF_VOCAB"
        )


def resolve(
    requested: RequestedSampling,
    config: SamplingSettings,
    rollout: RolloutSettings,
    prompt_len: int,
    limits: ModelLimits,
) -> Resolved:
    """Merges a request's sampling with the router's config; raises InvalidInput naming the bad field."""
    ignored: list[str] = []
    protected = {name: getattr(rollout if name in FROM_ROLLOUT else config, name) for name in PROTECTED}
    for name in PROTECTED:
        value = getattr(requested, name)
        if value is None or _same(value, protected[name]):
            continue
        if config.on_protected_override == "ignore":
            ignored.append(name)
            continue
        raise InvalidInput(
            f"sampling_params.{name} is protected: the router's value is {protected[name]}, "
            f"the request asked for {value}; leave it unset",
            reason="PROTECTED_SAMPLING_OVERRIDE",
            metadata={"field": name},
        )
    if requested.max_tokens < 0 or requested.max_tokens > config.max_tokens_cap:
        raise InvalidInput(
            f"sampling_params.max_tokens {requested.max_tokens} is outside [0, {config.max_tokens_cap}]",
            reason="MAX_TOKENS_OVER_CAP",
        )
    if not 0 <= requested.sample_count <= MAX_SAMPLES:
        raise InvalidInput(
            f"sampling_params.sample_count {requested.sample_count} is outside [0, {MAX_SAMPLES}]",
            reason="SAMPLE_COUNT_OUT_OF_RANGE",
        )
    if not 0 <= requested.top_logprob_count <= MAX_TOP_LOGPROBS:
        raise InvalidInput(
            f"sampling_params.top_logprob_count {requested.top_logprob_count} is outside [0, {MAX_TOP_LOGPROBS}]",
            reason="TOP_LOGPROBS_OUT_OF_RANGE",
        )
    bad_stops = [t for t in requested.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stops:
        raise InvalidInput(
            f"sampling_params.stop_token_ids {bad_stops} are outside [0, {limits.vocab_size})",
            reason="STOP_TOKEN_OUT_OF_VOCAB",
        )
    if any(not s for s in requested.stop_strings):
        raise InvalidInput("sampling_params.stop_strings contains an empty string", reason="EMPTY_STOP_STRING")
    # The generation budget never runs past the context: the sample then ends with LENGTH.
    max_tokens = min(requested.max_tokens or config.max_tokens_default, limits.max_model_len - prompt_len)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        stop_token_ids=requested.stop_token_ids,
        stop_strings=requested.stop_strings,
        seed=requested.seed,
        sample_count=requested.sample_count or 1,
        top_logprob_count=requested.top_logprob_count,
    )
    return Resolved(sampling, tuple(ignored))


def vllm_params(sampling: Sampling, final_only: bool) -> Any:
    """vLLM's ``SamplingParams`` for ``sampling``. With ``final_only`` vLLM hands out each sample once,
    finished (no output per ``stream_interval`` tokens: what a unary call needs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=sampling.sample_count,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        stop_token_ids=list(sampling.stop_token_ids),
        stop=list(sampling.stop_strings),
        include_stop_str_in_output=True,
        seed=sampling.seed,
        logprobs=sampling.top_logprob_count,
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
        # Token ids out, so text is needed only to match stop strings: skip the detokenizer otherwise.
        detokenize=bool(sampling.stop_strings),
    )
