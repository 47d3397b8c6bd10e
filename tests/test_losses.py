"""Token losses, KL estimators, aggregations, GAE / value loss, DPO: hand examples and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.losses import (
    AGGREGATIONS,
    DPO_LOSSES,
    KL_ESTIMATORS,
    Denominators,
    agg_dr_grpo,
    clip_surrogate,
    entropy_bonus,
    gae,
    kl_k3,
    kl_k3_ratio,
    value_loss,
    zero_pad,
)

ln = math.log


# --- clip surrogate ---------------------------------------------------------------------------------

def _ratios(r):
    logp = torch.tensor([[ln(x) for x in r]], requires_grad=True)
    return logp, torch.zeros_like(logp)


def test_clip_surrogate_hand_example_asymmetric():
    # ratio r = [1.5, 1.1, 0.5, 3.0], A = [+1, +1, -1, -1], eps_low = .2, eps_high = .28
    # t0: min(1.5, clip=1.28)*1 = 1.28 -> loss -1.28 (high-clipped, no gradient)
    # t1: min(1.1, 1.1) = 1.1        -> loss -1.1  (d loss / d logp = -A r = -1.1)
    # t2: min(-.5, -.8) = -.8        -> loss  .8   (low-clipped, no gradient)
    # t3: min(-3, -1.28) = -3        -> loss  3.0  (unclipped: d/dlogp = -A r = 3.0)
    logp, logp_old = _ratios([1.5, 1.1, 0.5, 3.0])
    adv, mask = torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)
    loss, stats = clip_surrogate(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -1.1, 0.8, 3.0]]))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -1.1, 0.0, 3.0]]))
    # one of four tokens each: low (t2), high (t0); region = 2/4
    keys = ("clip/low_frac", "clip/high_frac", "clip/region_frac")
    assert [stats[k].item() for k in keys] == [0.25, 0.25, 0.5]
    torch.testing.assert_close(stats["ratio/mean"], torch.tensor((1.5 + 1.1 + 0.5 + 3.0) / 4))
    assert all(not v.requires_grad for v in stats.values())


def test_clip_stats_are_masked_fractions():
    # ratios [1.5, 1.1, .5, 3], A = +1 for all, t0 masked out (it would be high: 1.5 > 1.28, A > 0).
    # Of t1..t3: t2 r=.5 < .8 but A > 0 -> not low; t3 r=3 > 1.28, A > 0 -> high. low 0/3, high 1/3
    logp, logp_old = _ratios([1.5, 1.1, 0.5, 3.0])
    _, stats = clip_surrogate(logp, logp_old, torch.tensor([1.0, ]), torch.tensor([[0, 1, 1, 1]]),
                              eps_low=0.2, eps_high=0.28)
    assert stats["clip/low_frac"].item() == 0.0
    assert abs(stats["clip/high_frac"].item() - 1 / 3) < 1e-7
    assert abs(stats["clip/region_frac"].item() - 1 / 3) < 1e-7


def test_clip_surrogate_rejects_bad_input():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shapes must match.*logp_old': \(2, 4\)"):
        clip_surrogate(logp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"adv must be \(N,\)=2 or \(N, T\)"):
        clip_surrogate(logp, logp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask selects no tokens"):
        clip_surrogate(logp, logp, torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mask shape"):
        clip_surrogate(logp, logp, torch.zeros(2), torch.ones(2, 2))


# --- REINFORCE equivalence and gradient isolation (hypothesis) ---------------------------------------

batch_st = st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))


def _random_batch(N, T, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = (torch.rand(N, T, generator=g) < 0.7).double()
    mask[0, 0] = 1.0  # never an all-zero mask
    return logp, adv, mask


@settings(max_examples=40, deadline=None)
@given(b=batch_st, agg=st.sampled_from(sorted(AGGREGATIONS)))
def test_ratio_one_clip_gradient_equals_reinforce(b, agg):
    N, T, seed = b
    logp0, adv, mask = _random_batch(N, T, seed)
    denoms = Denominators(n_seqs=N, n_tokens=int(mask.sum()), const=float(N * (T + 2)))
    logp = logp0.clone().requires_grad_(True)
    loss_tok, stats = clip_surrogate(logp, logp.detach(), adv, mask, eps_low=0.2, eps_high=0.28)
    (g_clip,) = torch.autograd.grad(AGGREGATIONS[agg](loss_tok, mask, denoms)[0], logp)
    logp_r = logp0.clone().requires_grad_(True)
    reinforce = -adv[:, None] * logp_r  # REINFORCE: -A * logp, same aggregation
    (g_rf,) = torch.autograd.grad(AGGREGATIONS[agg](reinforce, mask, denoms)[0], logp_r)
    torch.testing.assert_close(g_clip, g_rf)
    assert stats["clip/region_frac"].item() == 0.0


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_no_gradient_reaches_logp_old_or_logp_ref(name):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_old = torch.tensor([[-1.2, -1.9]], requires_grad=True)
    logp_ref = torch.tensor([[-0.7, -2.5]], requires_grad=True)
    mask = torch.ones(1, 2)
    kl, _ = KL_ESTIMATORS[name](logp, logp_ref, mask, logp_old=logp_old)
    surr, _ = clip_surrogate(logp, logp_old, torch.tensor([0.5]), mask)
    (kl + surr).sum().backward()
    assert logp.grad is not None and logp_old.grad is None and logp_ref.grad is None


# --- KL estimators ----------------------------------------------------------------------------------

def test_kl_hand_example():
    # pi = .5, pi_ref = .25: log r = log(.25/.5) = -0.6931472
    # k1 = -log r = 0.6931472; k2 = (log r)^2 / 2 = 0.2402265
    # k3 = (r - 1) - log r = -.5 + .6931472 = 0.1931472
    # k3_ratio with pi_old = .25: w = .5/.25 = 2 -> 0.3862944
    logp, logp_ref = torch.tensor([[ln(0.5)]]), torch.tensor([[ln(0.25)]])
    logp_old = torch.tensor([[ln(0.25)]])
    expect = {"k1": 0.6931472, "k2": 0.2402265, "k3": 0.1931472, "k3_ratio": 0.3862944}
    for name, value in expect.items():
        kl, stats = KL_ESTIMATORS[name](logp, logp_ref, torch.ones(1, 1), logp_old=logp_old)
        assert abs(kl.item() - value) < 1e-6, name
        assert abs(stats["kl/mean"].item() - value) < 1e-6


@settings(max_examples=100, deadline=None)
@given(a=st.floats(-20, 0), b=st.floats(-20, 0))
def test_k3_nonnegative_and_zero_iff_equal(a, b):
    logp, logp_ref = torch.tensor([[a]], dtype=torch.float64), torch.tensor([[b]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    k3 = kl_k3(logp, logp_ref, mask)[0].item()
    assert k3 >= 0.0
    if a == b:
        assert k3 == 0.0
    elif abs(a - b) > 1e-6:  # k3 ~ (log r)^2 / 2, below ~1e-8 it rounds to 0 in float64
        assert k3 > 0.0
    same = {name: fn(logp, logp, mask, logp_old=logp)[0].item() for name, fn in KL_ESTIMATORS.items()}
    assert all(v == 0.0 for v in same.values()), same
    assert KL_ESTIMATORS["k2"](logp, logp_ref, mask)[0].item() >= 0.0


def test_k3_ratio_gradient_is_exact_kl_gradient_on_policy():
    # Enumerate every token y of a 4-token vocabulary at one position, sampled from pi_old = pi (detached).
    # E_{pi_old}[grad (pi/pi_old) k3] must equal grad KL(pi || pi_ref) exactly; plain k3 gives instead
    # the gradient of the reverse KL(pi_ref || pi) (the bias DeepSeek-V3.2 corrects).
    theta = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.5, 1.0], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    p_old = logp.detach().exp()
    mask = torch.ones(1, 4)
    kr, _ = kl_k3_ratio(logp[None], ref[None], mask, logp_old=logp.detach()[None])
    (g_ratio,) = torch.autograd.grad((p_old * kr[0]).sum(), theta, retain_graph=True)
    k3, _ = kl_k3(logp[None], ref[None], mask)
    (g_k3,) = torch.autograd.grad((p_old * k3[0]).sum(), theta, retain_graph=True)
    (g_fwd,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)
    (g_rev,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    torch.testing.assert_close(g_ratio, g_fwd)
    torch.testing.assert_close(g_k3, g_rev)


def test_k3_ratio_needs_logp_old():
    with pytest.raises(ValueError, match=r"logp_old \(N, T\) is required"):
        kl_k3_ratio(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="shapes must match"):
        KL_ESTIMATORS["k3"](torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


# --- aggregations -----------------------------------------------------------------------------------

def test_aggregations_hand_example():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # step: B = 1 prompt, G = 2, max_new_tokens = 5 -> n_seqs 2, n_tokens 4, const 2 * 5 * 1 = 10
    d = Denominators.for_step(mask, group_size=2, max_new_tokens=5, prompts_per_step=1)
    assert d == Denominators(n_seqs=2, n_tokens=4, const=10.0)
    # grpo: (6/3 + 4/1) / 2 = 3; bnpo: (6 + 4) / 4 * (2/2) = 2.5; dapo: 10 / 4 = 2.5; dr_grpo: 10 / 10 = 1
    got = {name: fn(loss, mask, d)[0].item() for name, fn in AGGREGATIONS.items()}
    assert got == {"grpo": 3.0, "bnpo": 2.5, "dapo": 2.5, "dr_grpo": 1.0}
    assert {name: fn(loss, mask.bool(), d)[0].item() for name, fn in AGGREGATIONS.items()} == got


def test_inf_at_padding_changes_nothing():
    # the hand example with inf / nan where the mask is 0: x * mask would give nan; zero_pad gives 0
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, math.inf, math.nan]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(zero_pad(loss, mask), torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]))
    d = Denominators.for_step(mask, group_size=2, max_new_tokens=5, prompts_per_step=1)
    got = {name: fn(loss, mask, d)[0].item() for name, fn in AGGREGATIONS.items()}
    assert got == {"grpo": 3.0, "bnpo": 2.5, "dapo": 2.5, "dr_grpo": 1.0}  # as in the hand example
    # a padded logp_old = -inf: ratio e^inf there, yet the surrogate's value and stats stay finite
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss_tok, stats = clip_surrogate(logp, torch.tensor([[-1.0, -math.inf]]), torch.tensor([1.0]),
                                     torch.tensor([[1.0, 0.0]]))
    value, _ = AGGREGATIONS["dr_grpo"](loss_tok, torch.tensor([[1.0, 0.0]]), Denominators(1, 1, 2.0))
    assert value.item() == -0.5  # -A * ratio 1 on the one real token, / const 2
    assert stats["ratio/mean"].item() == 1.0 and stats["clip/region_frac"].item() == 0.0


def test_all_empty_step_is_refused_with_a_reason():
    # every completion empty: n_tokens would be 0 (0/0 in bnpo/dapo); the aggregations refuse such masks
    with pytest.raises(ValueError, match="selects no tokens.*skip the step"):
        Denominators.for_step(torch.zeros(2, 3), group_size=2, max_new_tokens=3, prompts_per_step=1)


def test_every_stat_is_detached():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref, old, mask = torch.tensor([[-0.5, -2.5]]), torch.tensor([[-1.1, -1.8]]), torch.ones(1, 2)
    d = Denominators(n_seqs=1, n_tokens=2, const=4.0)
    results = [clip_surrogate(logp, old, torch.tensor([1.0]), mask)[1],
               value_loss(logp, old, ref, mask)[1], entropy_bonus(-logp, mask, coef=0.1)[1],
               gae(logp, logp * 2, mask, gamma=0.9, lam=0.9)[2]]
    results += [fn(logp, ref, mask, logp_old=old)[1] for fn in KL_ESTIMATORS.values()]
    results += [fn(logp.sum(1) * 2, logp.sum(1), ref.sum(1), old.sum(1))[1] for fn in DPO_LOSSES.values()]
    results += [fn(logp, mask, d)[1] for fn in AGGREGATIONS.values()]
    for stats in results:
        assert stats and all(not v.requires_grad for v in stats.values()), stats


@settings(max_examples=40, deadline=None)
@given(b=batch_st, n_micro=st.integers(1, 3))
def test_micro_batch_values_sum_to_the_step_loss(b, n_micro):
    N, T, seed = b
    loss, _, mask = _random_batch(N, T, seed)
    mask[:, 0] = 1.0  # every row non-empty, so every micro-batch is
    d = Denominators(n_seqs=N, n_tokens=int(mask.sum()), const=float(N * T * 2))
    chunks = list(zip(loss.tensor_split(n_micro), mask.tensor_split(n_micro)))
    chunks = [(lt, m) for lt, m in chunks if m.shape[0]]
    for name in ("grpo", "dapo", "dr_grpo"):
        whole = AGGREGATIONS[name](loss, mask, d)[0]
        parts = sum(AGGREGATIONS[name](lt, m, d)[0] for lt, m in chunks)
        torch.testing.assert_close(parts, whole, msg=name)
    # bnpo = micro-batch token means weighted by the micro-batch's share of sequences (TRL: / accum steps)
    parts = sum(AGGREGATIONS["bnpo"](lt, m, d)[0] for lt, m in chunks)
    expect = sum((lt * m).sum() / m.sum() * m.shape[0] / N for lt, m in chunks)
    torch.testing.assert_close(parts, expect)


@settings(max_examples=40, deadline=None)
@given(b=batch_st, max_new=st.integers(6, 20))
def test_aggregations_agree_on_equal_lengths(b, max_new):
    N, T, seed = b
    loss, _, _ = _random_batch(N, T, seed)
    mask = torch.ones(N, T, dtype=torch.float64)  # every sequence has length T
    d = Denominators(n_seqs=N, n_tokens=N * T, const=float(N * max_new))
    v = {name: fn(loss, mask, d)[0] for name, fn in AGGREGATIONS.items()}
    torch.testing.assert_close(v["grpo"], v["bnpo"])
    torch.testing.assert_close(v["grpo"], v["dapo"])
    # dr_grpo divides by N * max_new_tokens instead of N * T: the documented constant T / max_new_tokens
    torch.testing.assert_close(v["dr_grpo"], v["grpo"] * T / max_new)


@settings(max_examples=40, deadline=None)
@given(b=batch_st, pad=st.integers(1, 5))
def test_dr_grpo_invariant_to_padding_length(b, pad):
    N, T, seed = b
    loss0, _, mask = _random_batch(N, T, seed)
    d = Denominators(n_seqs=N, n_tokens=int(mask.sum()), const=float(N * 32))
    loss = loss0.clone().requires_grad_(True)
    v, _ = agg_dr_grpo(loss, mask, d)
    (g,) = torch.autograd.grad(v, loss)
    junk = torch.randn(N, pad, dtype=torch.float64) * 100  # padded columns hold arbitrary finite values
    loss_p = torch.cat([loss0, junk], 1).requires_grad_(True)
    mask_p = torch.cat([mask, torch.zeros(N, pad, dtype=mask.dtype)], 1)
    v_p, _ = agg_dr_grpo(loss_p, mask_p, d)
    (g_p,) = torch.autograd.grad(v_p, loss_p)
    torch.testing.assert_close(v_p, v)
    torch.testing.assert_close(g_p[:, :T], g)
    assert (g_p[:, T:] == 0).all()


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregation_bad_input(name):
    d = Denominators(n_seqs=2, n_tokens=4, const=8.0)
    with pytest.raises(ValueError, match="mask selects no tokens"):
        AGGREGATIONS[name](torch.ones(2, 2), torch.zeros(2, 2), d)
    with pytest.raises(ValueError, match=r"mask shape \(2, 3\) != loss/logp shape \(2, 2\)"):
        AGGREGATIONS[name](torch.ones(2, 2), torch.ones(2, 3), d)
    with pytest.raises(ValueError, match="exceeds the step totals"):
        AGGREGATIONS[name](torch.ones(3, 2), torch.ones(3, 2), d)


def test_denominators_bad_input():
    with pytest.raises(ValueError, match=r"expected prompts_per_step \* group_size = 2 \* 4 = 8"):
        Denominators.for_step(torch.ones(6, 3), group_size=4, max_new_tokens=8, prompts_per_step=2)
    with pytest.raises(ValueError, match="T=9 > max_new_tokens=8"):
        Denominators.for_step(torch.ones(8, 9), group_size=4, max_new_tokens=8, prompts_per_step=2)
    with pytest.raises(ValueError, match="must be positive"):
        Denominators(n_seqs=0, n_tokens=1, const=1.0)


# --- PPO pieces --------------------------------------------------------------------------------------

def test_gae_hand_example():
    r, v, m = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.5, 0.5]]), torch.ones(1, 3)
    # gamma = lam = 1: delta = [0 + .5 - .5, 0 + .5 - .5, 1 + 0 - .5] = [0, 0, .5]
    # A = suffix sums = [.5, .5, .5]
    adv, ret, _ = gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    # gamma = .9, lam = .5: A2 = .5; delta1 = .9*.5 - .5 = -.05, A1 = -.05 + .45*.5 = .175
    # delta0 = -.05, A0 = -.05 + .45*.175 = .02875
    adv, _, _ = gae(r, v, m, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.02875, 0.175, 0.5]]))
    # a masked middle token (value 99, reward 7) is skipped: A2 = .5, A1 = 0,
    # delta0 = 0 + .9*V2 - .5 = -.05, A0 = -.05 + .45*.5 = .175 (as if t0 -> t2 were adjacent)
    adv, _, _ = gae(torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[0.5, 99.0, 0.5]]),
                    torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.175, 0.0, 0.5]]))
    with pytest.raises(ValueError, match="gamma, lam in"):
        gae(r, v, m, gamma=1.5, lam=1.0)


def test_value_loss_hand_example():
    # V = 1.5, V_old = 1.0, R = 2.0, c = .2: unclipped (1.5 - 2)^2 = .25; V_clip = 1.2 -> (1.2 - 2)^2 = .64
    # loss = .5 * max(.25, .64) = .32; the clipped branch is flat in V -> zero gradient; clip_frac 1
    values = torch.tensor([[1.5]], requires_grad=True)
    one = torch.ones(1, 1)
    loss, stats = value_loss(values, one, 2 * one, one, clip_range=0.2)
    assert abs(loss.item() - 0.32) < 1e-6 and stats["value/clip_frac"].item() == 1.0
    (g,) = torch.autograd.grad(loss.sum(), values)
    assert g.item() == 0.0
    # V = 1.1 inside the clip range: .5 * (1.1 - 2)^2 = .405, gradient V - R = -.9
    values = torch.tensor([[1.1]], requires_grad=True)
    loss, _ = value_loss(values, one, 2 * one, one, clip_range=0.2)
    (g,) = torch.autograd.grad(loss.sum(), values)
    assert abs(loss.item() - 0.405) < 1e-6 and abs(g.item() + 0.9) < 1e-6


def test_entropy_bonus_hand_example():
    # H = [1, 2], coef .01 -> loss_tok = [-.01, -.02]; entropy/mean over mask [1, 0] = 1
    loss, stats = entropy_bonus(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]]), coef=0.01)
    torch.testing.assert_close(loss, torch.tensor([[-0.01, -0.02]]))
    assert stats["entropy/mean"].item() == 1.0


# --- DPO ---------------------------------------------------------------------------------------------

def test_dpo_hand_example():
    # h = (logp_c - ref_c) - (logp_r - ref_r) = (-1 + 1.5) - (-2 + 1.5) = .5 + .5 = 1; beta = .1
    # sigmoid: -log sigma(.1) = log(1 + e^-.1) = 0.6443967; IPO: (1 - 1/(2*.1))^2 = (1 - 5)^2 = 16
    # hinge: relu(1 - .1 * 1) = .9
    args = (torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]))
    expect = {"sigmoid": 0.6443967, "ipo": 16.0, "hinge": 0.9}
    for name, value in expect.items():
        loss, stats = DPO_LOSSES[name](*args, beta=0.1)
        assert abs(loss.item() - value) < 1e-6, name
        assert stats["dpo/accuracy"].item() == 1.0
        assert abs(stats["dpo/reward_chosen"].item() - 0.05) < 1e-7  # .1 * (-1 + 1.5)


@pytest.mark.parametrize("name", sorted(DPO_LOSSES))
def test_dpo_bad_input_and_ref_gets_no_gradient(name):
    lc, lr = torch.tensor([-1.0, -3.0], requires_grad=True), torch.tensor([-2.0, -1.0], requires_grad=True)
    rc, rr = torch.tensor([-1.5, -2.0], requires_grad=True), torch.tensor([-1.5, -2.0], requires_grad=True)
    DPO_LOSSES[name](lc, lr, rc, rr, beta=0.1)[0].backward()
    assert lc.grad is not None and rc.grad is None and rr.grad is None
    with pytest.raises(ValueError, match="shapes must match"):
        DPO_LOSSES[name](lc, lr[:1], rc, rr, beta=0.1)
    with pytest.raises(ValueError, match=r"must be \(N,\) sequence log-probs"):
        DPO_LOSSES[name](torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), beta=0.1)
