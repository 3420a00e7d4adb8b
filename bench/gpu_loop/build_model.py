"""A Qwen3-shaped model of about 0.44B parameters with random weights, for the one-GPU loop.

The shape of Qwen3-0.6B (hidden 1024, 28 layers, 16 query heads and 8 KV heads of 128, MLP 3072,
tied embeddings) over molt's tiny byte-level tokenizer (molt.core.tiny_model), so its vocabulary
is 320 instead of 151 936: 0.44B parameters, nearly all of them in the decoder layers, which is
what the learner's step and the refit's bytes measure. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from molt.core.tiny_model import END_OF_TEXT, IM_END, build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TEXT)],
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {count / 1e9:.3f}B parameters")


if __name__ == "__main__":
    main()
