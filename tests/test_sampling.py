"""sampling.py: inverse-CDF draws (zero-mass tokens, the rounding edges, the distribution)."""

from __future__ import annotations

import torch

from projected_grpo.sampling import samplers as sampling
from projected_grpo.sampling.samplers import inverse_cdf


def test_inverse_cdf_picks_the_first_token_whose_mass_exceeds_u():
    # probs [0, 0.25, 0, 0.75] (row sum 1): CDF [0, 0.25, 0.25, 1.0]
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]])
    for u, want in [(0.0, 1),     # u = 0: the first CDF > 0 is index 1 (index 0 has no mass)
                    (0.2, 1),     # 0.25 > 0.2
                    (0.25, 3),    # CDF 0.25 is not > 0.25; index 2 has no mass, so 3
                    (0.9, 3)]:
        assert inverse_cdf(probs, torch.tensor([[u]], dtype=torch.float64)).tolist() == [want]
    # u rounding up to the row sum (searchsorted would give V): the first index reaching it, 1, not 3
    top = torch.ones((1, 1), dtype=torch.float64)
    assert inverse_cdf(torch.tensor([[0.5, 0.5, 0.0, 0.0]]), top).tolist() == [1]


def test_inverse_cdf_matches_the_distribution_and_skips_zero_mass():
    # unnormalised rows are fine: mass 2 : 0 : 6 : 2 -> 0.2 / 0 / 0.6 / 0.2
    probs = torch.tensor([2.0, 0.0, 6.0, 2.0]).expand(200_000, 4)
    u = torch.rand((200_000, 1), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tok = inverse_cdf(probs, u)
    freq = torch.bincount(tok, minlength=4).double() / tok.numel()
    assert freq[1] == 0
    # binomial SEM at p = 0.6, n = 2e5 is 0.0011: 0.005 is > 4 SEM
    assert torch.allclose(freq, torch.tensor([0.2, 0.0, 0.6, 0.2], dtype=torch.float64), atol=0.005)


def test_sampler_logp_is_the_drawn_tokens_log_prob_and_seeded():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    u = lambda seed: sampling.uniforms([torch.Generator().manual_seed(seed)], 6, torch.device("cpu"))
    tok, lp = sampling.SAMPLERS["sample"](logits, 1.0, 1.0, u(3))
    assert torch.allclose(lp, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0])
    tok2, _ = sampling.SAMPLERS["sample"](logits, 1.0, 1.0, u(3))
    assert torch.equal(tok, tok2)


def test_uniforms_split_over_one_generator_per_prompt():
    # 3 prompts x 2 rows, one Generator each: rows 2b, 2b + 1 are prompt b's own first two draws
    gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    u = sampling.uniforms(gens, 6, torch.device("cpu"))
    for b, s in enumerate((5, 6, 7)):
        alone = torch.rand((2, 1), dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        assert torch.equal(u[2 * b:2 * b + 2], alone)
