"""LoRA RL on the tiny model: only the adapters move, the reference is the base with them off, a refit
sends merged weights under the base's names, and a checkpoint of adapters resumes exactly."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from molt.core.errors import ConfigError
from molt.core.tiny_model import build
from molt.learner.batch import StepBatch
from molt.learner.checkpoint import CheckpointError, Checkpoints, RunState
from molt.learner.config import LearnerSettings
from molt.learner.refit import gather_for_refit, probe_token_ids
from molt.learner.synthetic import step_batch
from molt.learner.trainer import Trainer

SettingsFactory = Callable[..., LearnerSettings]
LORA = {"rank": 4, "alpha": 8.0}


def batch() -> StepBatch:
    return step_batch({"alpha": [1.0, 0.0, 1.0, 0.0], "beta": [0.0, 0.0, 1.0, 0.5]})


def named(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_only_the_adapters_train_and_the_reference_is_the_base(learner_settings: SettingsFactory) -> None:
    trainer = Trainer(learner_settings(lora=LORA, algorithm={"kl_coef": 0.1}, optimizer={"lr": 1e-2}))
    assert trainer.reference is None  # no second copy: the base, adapters off, is the reference
    before = named(trainer)
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    first = trainer.train_step(batch())
    second = trainer.train_step(batch())
    after = named(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)  # the base stays put
    assert any(not torch.equal(before[n], after[n]) for n in trainable if "lora_B" in n)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # B starts at 0: the policy is the base
    assert second["kl"] > 1e-7


def test_a_refit_sends_merged_weights_under_the_base_names(learner_settings: SettingsFactory, tiny_model: Path) -> None:
    trainer = Trainer(learner_settings(lora=LORA, optimizer={"lr": 1e-2}))
    trainer.train_step(batch())
    probe = probe_token_ids(trainer.vocab_size, 8)
    state, logprobs = gather_for_refit(trainer.model, probe)
    merged = copy.deepcopy(trainer.model).merge_and_unload()  # PEFT's own merge, for comparison
    expected = merged.state_dict()
    if merged.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(state) == set(expected)  # the base model's own names
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        ids = torch.tensor([probe])
        reference = torch.log_softmax(merged(input_ids=ids).logits[0, :-1].float(), -1)
    want = reference.gather(1, ids[0, 1:, None])[:, 0].tolist()
    assert logprobs == pytest.approx(want, abs=1e-5)


def test_adapters_resume_exactly_and_only_on_their_base(learner_settings: SettingsFactory, tmp_path: Path) -> None:
    settings = learner_settings(lora=LORA, optimizer={"lr": 1e-2, "warmup_steps": 3, "total_steps": 10})
    straight = Trainer(settings)
    straight.train_step(batch())
    straight.train_step(batch())
    interrupted = Trainer(settings)
    interrupted.train_step(batch())
    path = Checkpoints(tmp_path / "ckpt", keep=2).save(interrupted, RunState(step=1, policy_version=1))
    saved = torch.load(path / "model.pt", weights_only=True)
    assert saved and all(".lora_" in name for name in saved)  # the adapters alone
    resumed = Trainer(settings)
    Checkpoints(tmp_path / "ckpt", keep=2).load(resumed, path)
    resumed.train_step(batch())
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    other = build(tmp_path / "other", seed=1)
    with pytest.raises(CheckpointError, match="another model"):
        Checkpoints(tmp_path / "ckpt", keep=2).load(Trainer(learner_settings(lora=LORA, model_path=other)), path)
    with pytest.raises(CheckpointError, match="this run has none"):
        Checkpoints(tmp_path / "ckpt", keep=2).load(Trainer(learner_settings()), path)
    fewer = learner_settings(lora={**LORA, "target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(CheckpointError, match="not this run's"):
        Checkpoints(tmp_path / "ckpt", keep=2).load(Trainer(fewer), path)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # PEFT's, on the tied embedding
def test_adapters_on_other_than_linear_layers_are_refused(learner_settings: SettingsFactory) -> None:
    with pytest.raises(ConfigError, match="linear layers only"):
        Trainer(learner_settings(lora={**LORA, "target_modules": ["embed_tokens", "q_proj"]}))
