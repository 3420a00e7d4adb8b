"""Loading the models: the longest context a model's config allows, and where the decoder layers are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from molt.core.errors import ConfigError
from molt.core.tiny_model import ARCHITECTURES, build_config
from molt.learner.models import decoder_layers, model_context


def test_model_context_applies_rope_scaling_as_vllm_does() -> None:
    assert model_context(SimpleNamespace(max_position_embeddings=2048)) == 2048
    yarn = SimpleNamespace(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert model_context(yarn) == 131072
    assert model_context(SimpleNamespace(max_position_embeddings=512, rope_scaling=None)) == 512
    assert model_context(SimpleNamespace()) is None


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_decoder_layers_of_the_dense_families(arch: str) -> None:
    config = build_config(vocab_size=64, hidden_size=64, layers=3, max_positions=32, arch=arch, tied=False)
    model = ARCHITECTURES[arch][1](config)
    layers = decoder_layers(model)
    assert layers is model.model.layers and len(layers) == 3


def test_decoder_layers_found_where_gpt2_keeps_them() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32))
    assert not hasattr(model, "model")
    assert decoder_layers(model) is model.transformer.h


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))
        self.gate = nn.Linear(4, 8)


class Unnamed(nn.Module):
    """No ``_no_split_modules``: 2 blocks holding 8 experts each; the blocks hold more parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])
        self.blocks = nn.ModuleList(Block() for _ in range(2))


def test_without_no_split_modules_the_blocks_with_most_parameters_win() -> None:
    model = Unnamed()
    # 2 x (8 x 20 + 40) = 400 parameters in the blocks against 160 in either block's experts.
    assert decoder_layers(model) is model.blocks


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.stack = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.LayerNorm(8)])
        self.empty = nn.ModuleList([nn.ReLU(), nn.ReLU()])


def test_a_model_without_repeated_blocks_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="decoder layers of Flat"):
        decoder_layers(Flat())
