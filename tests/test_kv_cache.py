"""kv_cache.py: the cache keyword and the returned cache under the installed transformers' names, and no
deprecation notice from our forwards (transformers >= 5.24 renamed `past_key_values` to `cache`; a call with
the old name warns through `warnings` (pyproject's filterwarnings turns that into a failure) and reading
`out.past_key_values` logs once through transformers' logger, which this file checks)."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from projected_grpo.knobs.adapters import wrap
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.kv_cache import KV_CACHES, cache_of, with_cache
from projected_grpo.sampling.prefix import pack_prefix, prefix_logprobs

LLAMA = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")).eval()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_keyword_is_the_forwards_own(model):
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = KV_CACHES["preallocated"](model, 8)
    assert with_cache(model, cache) == {name: cache}
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **with_cache(model, cache))
    assert cache_of(out) is cache and cache.get_seq_length() == 3


def test_no_deprecation_notice_from_our_forwards(model):
    """generate (both KV caches, lean and HF steps, shared prefill) and prefix scoring with gradient
    checkpointing log nothing deprecated (transformers' warning_once cache is cleared first, so a notice
    another test triggered earlier would show here again)."""
    logging.Logger.warning_once.cache_clear()  # transformers.utils.logging's lru_cache'd warning_once
    handler = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        for kv_cache in ("preallocated", "dynamic"):
            for lean in (True, False):
                generate(model, [[1, 2, 3], [4, 5]], 2, max_new_tokens=3, seed=0, eos_id=[], pad_id=0,
                         kv_cache=kv_cache, lean=lean, share_prefill=True)
        knobs = wrap(model, "svd")
        knobs.gradient_checkpointing()
        batch = pack_prefix([[1, 2, 3]] * 2, [[4, 5], [6]], 0, [True, False])
        with knobs.capture(torch.tensor([True, False])) as cap:
            logp, _ = prefix_logprobs(model, batch, capture=cap)
            logp.sum().backward()
    finally:
        logger.removeHandler(handler)
    assert not [m for m in handler.messages if "deprecated" in m], handler.messages
