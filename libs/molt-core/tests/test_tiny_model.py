"""The tiny model builder: deterministic, head_dim 64, single-token chat specials, other architectures."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.core.tiny_model import EXPERTS, HEAD_DIM, MARKUP_TOKENS, SPECIAL_TOKENS, TOP_K, build, build_tokenizer, main


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a, b, c = build(tmp_path / "a", seed=3), build(tmp_path / "b", seed=3), build(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name), name
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors")


def test_model_and_tokenizer_fit_together(tmp_path: Path) -> None:
    path = build(tmp_path / "m", layers=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2"
    assert model.config.head_dim == HEAD_DIM
    assert len(tokenizer) <= model.config.vocab_size
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token

    messages = [{"role": "user", "content": "12+7= ünïcode"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n12+7= ünïcode<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == text
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    # Plain text never encodes to a control token.
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in tokenizer.encode(
        "<|im_start", add_special_tokens=False
    )

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_template_renders_tools_and_history_as_prefix(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build(tmp_path / "m", layers=1))
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    first = [{"role": "user", "content": "2*3?"}]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}}],
    }
    second = [*first, call, {"role": "tool", "content": "6"}]
    render = tokenizer.apply_chat_template
    one = render(first, tools=tools, tokenize=False, add_generation_prompt=False)
    two = render(second, tools=tools, tokenize=False, add_generation_prompt=True)
    assert two.startswith(one)
    assert '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call><|im_end|>' in two
    assert two.endswith("<tool_response>6</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "calc"' in one.split("<|im_end|>")[0]  # the tool list is in the system turn


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen3", False)])
def test_other_architectures_and_an_untied_head(tmp_path: Path, arch: str, tied: bool) -> None:
    path = build(tmp_path / arch, layers=1, arch=arch, tied=tied)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch and model.config.tie_word_embeddings is tied
    head, embedding = model.lm_head.weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embedding.data_ptr()) is tied
    # save_pretrained writes a tied head once, as the embedding.
    assert ("lm_head.weight" in checkpoint_names(path)) is not tied
    assert AutoTokenizer.from_pretrained(path).chat_template == build_tokenizer().chat_template


def test_an_unknown_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'"):
        build(tmp_path / "m", arch="gpt2")


def test_the_moe_model_is_deterministic_and_sparse_in_every_layer(tmp_path: Path) -> None:
    """``--moe``: Qwen3-MoE, 2 layers of 8 experts, top-2 renormalised, the dense model's tokenizer,
    saved per expert (the checkpoint layout vLLM loads); the same seed gives the same bytes."""
    main(["--moe", "--seed", "3", "--out", str(tmp_path / "a")])
    a, b = tmp_path / "a", build(tmp_path / "b", seed=3, arch="qwen3", moe=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name), name
    model = AutoModelForCausalLM.from_pretrained(a)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and config.model_type == "qwen3_moe"
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (2, 128, HEAD_DIM)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (EXPERTS, TOP_K, True)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Qwen3MoeSparseMoeBlock"] * 2
    assert AutoTokenizer.from_pretrained(a).get_vocab() == build_tokenizer().get_vocab()
    names = checkpoint_names(a)
    assert f"model.layers.1.mlp.experts.{EXPERTS - 1}.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names


def test_an_architecture_without_a_moe_sibling_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown mixture-of-experts architecture 'llama'"):
        build(tmp_path / "m", arch="llama", moe=True)


def checkpoint_names(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", "pt") as handle:
        return set(handle.keys())
