"""Loading the models: the longest context a model's config allows."""

from __future__ import annotations

from types import SimpleNamespace

from molt.learner.models import model_context


def test_model_context_applies_rope_scaling_as_vllm_does() -> None:
    assert model_context(SimpleNamespace(max_position_embeddings=2048)) == 2048
    yarn = SimpleNamespace(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert model_context(yarn) == 131072
    assert model_context(SimpleNamespace(max_position_embeddings=512, rope_scaling=None)) == 512
    assert model_context(SimpleNamespace()) is None
