"""Projection math (hand examples + hypothesis properties) and its application to knob grads/updates."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from projected_grpo.knobs.adapters import wrap
from projected_grpo.knobs.projection import apply_arm, project, project_update, purge_moments, snapshot

# ---------------------------------------------------------------- hand-computed examples

E = torch.eye(3)


def test_one_sided_hand_example():
    # V = [e0, e1]; g = [3, -2, 4]: c = [3, -2]; relu(c) = [3, 0] -> removed = [3, 0, 0], g_proj = [0, -2, 4]
    g_proj, removed, stats = project(torch.tensor([3.0, -2.0, 4.0]), E[:2])
    assert torch.equal(removed, torch.tensor([3.0, 0.0, 0.0]))
    assert torch.equal(g_proj, torch.tensor([0.0, -2.0, 4.0]))
    # cin = ‖relu(c)‖/‖g‖ = 3/sqrt(9+4+16) = 3/sqrt(29); after: c' = [0, -2] -> cout = 0
    assert math.isclose(stats["cin"].item(), 3 / math.sqrt(29), rel_tol=1e-6)
    assert stats["cout"].item() == 0.0 and stats["fired"].item() == 1.0


def test_no_gate_reverse_hand_example():
    g, V = torch.tensor([3.0, -2.0, 4.0]), E[:2]
    # no_gate removes c·V = [3, -2, 0] -> [0, 0, 4]
    assert torch.equal(project(g, V, "no_gate")[0], torch.tensor([0.0, 0.0, 4.0]))
    # reverse removes 2c·V = [6, -4, 0] -> [-3, 2, 4]: V·g flips from [3, -2] to [-3, 2]
    assert torch.equal(project(g, V, "reverse")[0], torch.tensor([-3.0, 2.0, 4.0]))


def test_g_inside_span_V_projects_to_exact_zero():
    # g = 2·v0 + 3·v1 with V = [v0, v1] rotated: no_gate removes all of it; rounding noise is snapped to 0,
    # so cout is 0, not a ratio of noise
    V = torch.tensor([[0.6, 0.8, 0.0], [-0.8, 0.6, 0.0]])
    g = 2 * V[0] + 3 * V[1]
    g_proj, removed, stats = project(g, V, "no_gate")
    assert torch.equal(g_proj, torch.zeros(3)) and stats["cout"].item() == 0.0
    torch.testing.assert_close(removed, g)


def test_edge_cases_zero_g_and_empty_V():
    g_proj, removed, stats = project(torch.zeros(3), E[:1])
    assert torch.equal(g_proj, torch.zeros(3)) and stats["cin"].item() == 0.0 and stats["cout"].item() == 0.0
    g = torch.tensor([1.0, 2.0, 3.0])
    g_proj, removed, stats = project(g, torch.zeros(0, 3))  # K = 0: nothing to remove
    assert torch.equal(g_proj, g) and torch.equal(removed, torch.zeros(3)) and stats["fired"].item() == 0.0
    # a row zeroed by τ_axis removes nothing either
    assert torch.equal(project(g, torch.zeros(1, 3))[0], g)
    with pytest.raises(ValueError, match="need g"):
        project(g, torch.zeros(3))
    with pytest.raises(ValueError, match="unknown gate"):
        project(g, E, gate="two_sided")


# ---------------------------------------------------------------- hypothesis properties


@st.composite
def g_and_V(draw):
    R = draw(st.integers(1, 12))
    K = draw(st.integers(0, R))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(R, generator=gen, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    V = torch.linalg.qr(torch.randn(R, K, generator=gen, dtype=torch.float64))[0].T  # (K, R) orthonormal rows
    return g, V


def tol(g):
    return 1e-9 * (1 + g.norm().item())


@settings(max_examples=60, deadline=None)
@given(gv=g_and_V(), gate=st.sampled_from(["one_sided", "no_gate"]))
def test_idempotent(gv, gate):
    g, V = gv
    once = project(g, V, gate)[0]
    twice = project(once, V, gate)[0]
    torch.testing.assert_close(twice, once, atol=tol(g), rtol=0)


@settings(max_examples=60, deadline=None)
@given(gv=g_and_V(), data=st.data())
def test_identity_when_no_hackward_component(gv, data):
    g, V = gv
    K = V.shape[0]
    a = torch.tensor(data.draw(st.lists(st.floats(0.1, 10.0), min_size=K, max_size=K)), dtype=torch.float64)
    g = g - V.T @ (V @ g) - V.T @ a  # V·g = -a < 0 strictly
    g_proj, removed, stats = project(g, V)
    assert torch.equal(g_proj, g) and torch.equal(removed, torch.zeros_like(g))
    assert stats["cin"].item() == 0.0


@settings(max_examples=60, deadline=None)
@given(gv=g_and_V(), gate=st.sampled_from(["one_sided", "no_gate", "reverse"]))
def test_removed_in_span_V(gv, gate):
    g, V = gv
    _, removed, _ = project(g, V, gate)
    # the part of `removed` outside span(V) is zero
    torch.testing.assert_close(removed - V.T @ (V @ removed), torch.zeros_like(g), atol=tol(g), rtol=0)


@settings(max_examples=60, deadline=None)
@given(gv=g_and_V())
def test_cout_zero_one_sided_and_projected_orthogonal(gv):
    g, V = gv
    g_proj, _, stats = project(g, V)
    assert stats["cout"].item() < 1e-9
    assert (V @ g_proj <= tol(g)).all()  # nothing hack-ward is left
    torch.testing.assert_close(project(g, V, "no_gate")[0] @ V.T, torch.zeros(V.shape[0], dtype=g.dtype),
                               atol=tol(g), rtol=0)  # no_gate leaves g ⟂ V


@settings(max_examples=60, deadline=None)
@given(gv=g_and_V())
def test_reverse_flips_V_dot_g(gv):
    g, V = gv
    g_proj = project(g, V, "reverse")[0]
    torch.testing.assert_close(V @ g_proj, -(V @ g), atol=tol(g), rtol=0)
    torch.testing.assert_close(g_proj.norm(), g.norm(), atol=tol(g), rtol=0)  # a reflection


# ---------------------------------------------------------------- arms over a wrapped model

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")


def wrapped(tmp_path, kind="svd"):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    knobs = wrap(model, kind, rank=2 if kind == "lora" else None, cache_dir=tmp_path)
    x = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    model(x).logits.logsumexp(-1).mean().backward()
    gen = torch.Generator().manual_seed(2)
    names = list(knobs.modules)
    # V for all but the last module; row 0 mostly along the gradient so the gate surely fires
    V_hack = {}
    for n in names[:-1]:
        g = knobs.grads()[n]
        noise = torch.randn(g.shape, generator=gen)
        Q = torch.linalg.qr(torch.stack([g + 0.5 * g.norm() * noise / noise.norm(),
                                         torch.randn(g.shape, generator=gen)], 1))[0].T  # (2, R)
        V_hack[n] = Q * torch.sign(Q[0] @ g)
    return knobs, V_hack


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_route_puts_exactly_removed_on_quarantine_and_erase_never_touches_it(kind, tmp_path):
    knobs, V_hack = wrapped(tmp_path, kind)
    g = {n: t.clone() for n, t in knobs.grads().items()}
    sentinel = {n: torch.full_like(p, 7.0) for n, p in zip(knobs.modules, knobs.hack_parameters())}
    for n, p in zip(knobs.modules, knobs.hack_parameters()):
        p.grad = sentinel[n].clone()
    apply_arm(knobs, V_hack, "erase")
    for n, p in zip(knobs.modules, knobs.hack_parameters()):
        assert torch.equal(p.grad, sentinel[n])  # erase never touches the quarantine knob
    for p in knobs.hack_parameters():
        p.grad = None
    knobs.set_grads(g)
    stats = apply_arm(knobs, V_hack, "route")
    hack, main = knobs.grads("hack"), knobs.grads()
    for n in knobs.modules:
        if n in V_hack:
            g_proj, removed, _ = project(g[n], V_hack[n])
            assert torch.equal(hack[n], removed) and torch.equal(main[n], g_proj)
        else:  # skipped: untouched
            assert torch.equal(main[n], g[n]) and torch.count_nonzero(hack[n]) == 0
    assert stats["proj/skipped"].item() == 1
    # every module with V fires (row 0 leans along g): 13 of 14
    assert math.isclose(stats["proj/fired_frac"].item(), 13 / 14, rel_tol=1e-6)
    assert stats["proj/cout"].item() < 1e-5 and stats["proj/cin"].item() > 0.5


def test_none_measures_only_and_aggregates_relu_before_sum(tmp_path):
    knobs, V_hack = wrapped(tmp_path)
    g = {n: t.clone() for n, t in knobs.grads().items()}
    stats = apply_arm(knobs, V_hack, "none")
    assert all(torch.equal(knobs.grads()[n], g[n]) for n in g)
    assert all(p.grad is None for p in knobs.hack_parameters())
    num = sum(torch.relu(V_hack[n] @ g[n]).square().sum() for n in V_hack)
    den = sum(g[n].square().sum() for n in V_hack)
    assert math.isclose(stats["proj/cin"].item(), (num / den).sqrt().item(), rel_tol=1e-5)
    assert stats["proj/cout"].item() == stats["proj/cin"].item()  # unchanged gradient


def test_module_means_hand_example():
    from projected_grpo.knobs.projection import module_means

    # two modules: per-module cin 0.6 and 0.0 -> seed mean 0.3; cout 0.0 and 0.0 -> 0.0. The pooled cin
    # would weigh them by gradient norm instead (module 1's g is 10x larger: sqrt(0.36) / sqrt(1 + 100))
    per_module = [{"cin": torch.tensor(0.6), "cout": torch.tensor(0.0)},
                  {"cin": torch.tensor(0.0), "cout": torch.tensor(0.0)}]
    got = module_means(per_module)
    assert math.isclose(got["proj/cin_module_mean"].item(), 0.3, rel_tol=1e-6)
    assert got["proj/cout_module_mean"].item() == 0.0
    assert module_means([])["proj/cin_module_mean"].item() == 0.0


@pytest.mark.parametrize("arm", ["none", "erase"])
def test_module_mean_is_the_mean_of_per_module_ratios(arm, tmp_path):
    knobs, V_hack = wrapped(tmp_path)
    g = {n: t.clone() for n, t in knobs.grads().items()}
    stats = apply_arm(knobs, V_hack, arm)
    ratios = [(torch.relu(V_hack[n] @ g[n]).norm() / g[n].norm()).item() for n in V_hack]
    assert math.isclose(stats["proj/cin_module_mean"].item(), sum(ratios) / len(ratios), rel_tol=1e-5)
    if arm == "none":  # nothing written: cout = cin, per module too
        assert stats["proj/cout_module_mean"].item() == stats["proj/cin_module_mean"].item()
    else:  # one-sided erase leaves no hack-ward part in any module
        assert stats["proj/cout_module_mean"].item() < 1e-5


def test_adamw_moves_the_quarantine_a_full_lr_per_coordinate_however_tiny_its_gradient(tmp_path):
    from projected_grpo.knobs.projection import snapshot, step_norms

    # issue 14's route measurement, by hand: AdamW's first step is lr * g / (|g| + eps) per coordinate (bias
    # correction makes m_hat = g, v_hat = g^2), so a routed gradient of 1e-6 moves each coordinate it
    # reaches by lr * 1e-6 / (1e-6 + 1e-8) = 0.099 (eps 1e-8): ||step|| = 0.0990 * sqrt(10) = 0.3131 for 10
    # coordinates, while the gradient's own norm is 1e-6 * sqrt(10)
    knobs, _ = wrapped(tmp_path)
    opt = torch.optim.AdamW(knobs.hack_parameters(), lr=0.1, weight_decay=0.0)
    first = knobs.hack_parameters()[0]
    first.grad = torch.zeros_like(first)
    first.grad.view(-1)[:10] = 1e-6
    before, before_hack = snapshot(knobs), snapshot(knobs, "hack")
    opt.step()
    got = step_norms(knobs, before, before_hack)
    assert math.isclose(got["knob/hack_step"].item(), 0.1 / 1.01 * math.sqrt(10), rel_tol=1e-4)
    assert got["knob/step"].item() == 0.0  # the main knobs were not in this optimizer


def test_per_source_cin(tmp_path):
    knobs, V_hack = wrapped(tmp_path)
    g = knobs.grads()

    class Split:  # the student half is exactly hack-ward, the teacher half exactly anti-hack-ward
        g_student = {n: V_hack[n][0].clone() for n in V_hack}
        g_teacher = {n: -V_hack[n][0].clone() for n in V_hack} | {"extra": g[next(iter(g))]}

    stats = apply_arm(knobs, V_hack, "none", split=Split)
    assert math.isclose(stats["proj/cin_student"].item(), 1.0, rel_tol=1e-5)
    assert abs(stats["proj/cin_teacher"].item()) < 1e-6


@pytest.mark.parametrize("arm", ["none", "erase", "route"])
def test_update_mode_with_adamw(arm, tmp_path):
    knobs, V_hack = wrapped(tmp_path)
    opt = torch.optim.AdamW(knobs.parameters(), lr=1e-2, weight_decay=0.0)
    before = snapshot(knobs)
    opt.step()
    raw = {n: knobs.values()[n] - before[n] for n in before}
    stats = project_update(knobs, before, V_hack, arm)
    after = knobs.values()
    for n in V_hack:
        kept = after[n] - before[n]
        if arm == "none":
            assert torch.equal(kept, raw[n])
        else:  # the update that stays is not hack-ward: V·(−Δ') ≤ 0
            assert (V_hack[n] @ (-kept) <= 1e-7).all()
        hack = knobs.values("hack")[n]
        if arm == "route":  # the removed motion moved to the quarantine: total motion unchanged
            torch.testing.assert_close(kept + hack, raw[n], atol=1e-7, rtol=0)
        else:
            assert torch.count_nonzero(hack) == 0
    assert stats["proj/cin_update"].item() > 0  # Adam's first step is sign(g)·lr: hack-ward against V
    if arm == "none":
        assert stats["proj/cout_update"].item() == stats["proj/cin_update"].item()
    else:
        assert stats["proj/cout_update"].item() < 1e-5


def test_purge_moments_removes_hackward_exp_avg_only(tmp_path):
    knobs, V_hack = wrapped(tmp_path)
    opt = torch.optim.AdamW(knobs.parameters(), lr=1e-2)
    opt.step()
    name = next(iter(V_hack))
    state = opt.state[knobs.modules[name].delta]
    sq = state["exp_avg_sq"].clone()
    assert (V_hack[name] @ state["exp_avg"].reshape(-1))[0] > 0  # exp_avg = .1·g is hack-ward on row 0
    stats = purge_moments(opt, knobs, V_hack)
    assert (V_hack[name] @ state["exp_avg"].reshape(-1) <= 1e-7).all()
    assert torch.equal(state["exp_avg_sq"], sq)  # a per-coordinate scale: left alone
    assert math.isclose(stats["proj/purged_frac"].item(), 13 / 14, rel_tol=1e-6)
    with pytest.raises(ValueError, match="purge gate"):
        purge_moments(opt, knobs, V_hack, gate="reverse")


# ---------------------------------------------------------------- erase_bounded: the knob cannot drift


def test_bound_drift_hand_example(tmp_path):
    from projected_grpo.knobs.projection import bound_drift

    knobs, _ = wrapped(tmp_path)
    name = next(iter(knobs.modules))
    d = knobs.values()[name]
    d.zero_()
    d[:3] = torch.tensor([1.0, 2.0, 0.0])
    V = {name: torch.zeros(2, d.numel())}
    V[name][0, 0], V[name][1, 2] = 1.0, 1.0  # rows e0, e2
    # a = V·δ = (1, 0): relu(a)·V = e0 -> δ = (0, 2, 0, ...); coefficients after (0, 0); ‖removed‖ = 1
    st_ = bound_drift(knobs, V, "erase_bounded")
    assert d[:3].tolist() == [0.0, 2.0, 0.0]
    assert st_["knob/v_coef"].item() == 0.0 and st_["knob/v_clamped"].item() == 1.0
    # a negative (hack-ward) coefficient is the gate's business, not the clamp's: (-1, 2, 0) stays
    d[0] = -1.0
    st_ = bound_drift(knobs, V, "erase_bounded")
    assert d[:3].tolist() == [-1.0, 2.0, 0.0] and st_["knob/v_coef"].item() == -1.0
    # share of ‖δ‖ in span(V): ‖(-1, 0)‖ / ‖(-1, 2, 0)‖ = 1 / sqrt(5); `erase` measures and leaves it
    assert math.isclose(st_["knob/v_share"].item(), 1 / math.sqrt(5), rel_tol=1e-6)
    d[0] = 3.0
    st_ = bound_drift(knobs, V, "erase")
    assert d[0].item() == 3.0 and st_["knob/v_coef"].item() == 3.0 and st_["knob/v_clamped"].item() == 0.0


@pytest.mark.parametrize("arm", ["erase", "erase_bounded"])
def test_erase_bounded_keeps_the_v_coefficient_bounded_where_erase_drifts(arm, tmp_path):
    from projected_grpo.knobs.projection import bound_drift

    # every step's gradient points anti-hack along V (c = V·g < 0), which the one-sided gate keeps: AdamW
    # then walks the knob along +V by ~lr a step under erase (docs/findings.md 7.2); erase_bounded's clamp
    # holds every coefficient at <= 0 whatever the number of steps
    knobs, V_hack = wrapped(tmp_path)
    for v in knobs.values().values():
        v.zero_()
    opt = torch.optim.AdamW(knobs.parameters(), lr=0.1, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    coefs = []
    for _ in range(30):
        grads = {n: -V_hack[n].sum(0) + 0.1 * torch.randn(V_hack[n].shape[1], generator=gen) for n in V_hack}
        for n, m in knobs.modules.items():
            g = grads[n].reshape(m.delta.shape) if n in grads else torch.zeros_like(m.delta)
            m.delta.grad = g.clone()
        apply_arm(knobs, V_hack, arm)
        opt.step()
        coefs.append(bound_drift(knobs, V_hack, arm)["knob/v_coef"].item())
    if arm == "erase":
        assert coefs[-1] > 10 * max(coefs[0], 1e-3) and coefs[-1] > 1.0  # drifts, step after step
    else:
        assert max(coefs) <= 1e-5
        for n in V_hack:
            assert (V_hack[n] @ knobs.values()[n].float() <= 1e-5).all()
