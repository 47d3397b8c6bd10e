"""Tiny Hugging Face models and knob helpers shared by the tests (adapters, merged, decode step, packed)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
ARCHS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
         "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL))}

# SmolLM2-style grouped-query attention (4 query heads share 2 key/value heads): the decode-step and bf16
# sampling tests' models, unseeded (each test file seeds its own)
GQA_VOCAB = 96
GQA = dict(vocab_size=GQA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
GQA_ARCHS = {
    "llama_sdpa": lambda: LlamaForCausalLM(LlamaConfig(**GQA, attn_implementation="sdpa")),
    "llama_eager": lambda: LlamaForCausalLM(LlamaConfig(**GQA, attn_implementation="eager")),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**GQA, attn_implementation="sdpa")),  # biased q/k/v
}


def tiny(arch="llama", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return ARCHS[arch]().to(dtype).eval()


def ids(n=3, t=7, seed=1):
    return torch.randint(0, 64, (n, t), generator=torch.Generator().manual_seed(seed))


def randomize(knobs, scale=0.1, seed=2):
    gen = torch.Generator().manual_seed(seed)
    for p in knobs.parameters() + knobs.hack_parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * scale)
