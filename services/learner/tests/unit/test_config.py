"""Start-up soundness: each unsafe combination is refused with its reason; the defaults are sound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from molt.core.errors import ConfigError
from molt.core.testing import nest_rollout
from molt.learner.config import LearnerSettings, check_sound, unsound_settings


def settings(**values: Any) -> LearnerSettings:
    return LearnerSettings(model_path=Path("models/tiny"), **nest_rollout(values))


def test_defaults_are_sound() -> None:
    assert unsound_settings(settings()) == []
    check_sound(settings())


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"algorithm": {"importance_sampling": {"level": "off"}}}, "max_staleness = 1.*needs importance-sampling"),
        (
            {
                "max_staleness": 0,
                "rollout": {"partial_rollout": True},
                "algorithm": {"importance_sampling": {"level": "off"}},
            },
            "partial_rollout = True.*needs importance-sampling",
        ),
        ({"algorithm": {"importance_sampling": {"level": "geo", "mode": "clip"}}}, "accepts only mode 'mask'"),
        ({"group_size": 1}, "estimator 'grpo' normalises within a prompt's group"),
        ({"group_size": 1, "algorithm": {"estimator": "rloo"}}, "estimator 'rloo'"),
        ({"rollout": {"top_p": 0.9}}, "top_p = 0.9 with IS correction"),
        ({"rollout": {"top_k": 20}}, "top_k = 20 with IS correction"),
        ({"algorithm": {"estimator": "on_policy_distill"}}, "needs algorithm.teacher_path"),
        ({"algorithm": {"teacher_path": "teacher"}}, "teacher_path is only used by on_policy_distill"),
        ({"mode": "sft"}, "needs an \\[learner.sft\\] table"),
        ({"max_staleness": 2, "drop_after_versions": 1}, "drop_after_versions = 1 is below max_staleness = 2"),
        ({"algorithm": {"kl_in_reward": True}}, "kl_in_reward needs kl_coef > 0"),
        ({"algorithm": {"kl_in_reward": True, "kl_coef": 0.1}}, "kl_in_reward has no effect with 'grpo'"),
        ({"algorithm": {"kl_target": 0.01}}, "kl_target adapts kl_coef from its start"),
        ({"algorithm": {"kl_coef": 0.1, "kl_target": 0.01, "kl_horizon": 1}}, "kl_horizon = 1 is below a fifth"),
        ({"mini_batches": 5, "groups_per_step": 4}, "mini_batches = 5 is more than the 4 groups"),
    ],
)
def test_unsound_settings_fail_fast_with_the_reason(values: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        check_sound(settings(**values))


def test_on_policy_without_is_and_a_single_sample_reinforce_are_sound() -> None:
    on_policy = settings(max_staleness=0, partial_rollout=False, algorithm={"importance_sampling": {"level": "off"}})
    assert unsound_settings(on_policy) == []
    assert unsound_settings(settings(group_size=1, algorithm={"estimator": "reinforce"})) == []
    distill = {"estimator": "on_policy_distill", "teacher_path": "teacher"}
    assert unsound_settings(settings(group_size=1, algorithm=distill)) == []
    assert (
        unsound_settings(
            settings(
                rollout={"top_p": 0.9, "partial_rollout": False},
                max_staleness=0,
                algorithm={"importance_sampling": {"level": "off"}},
            )
        )
        == []
    )
