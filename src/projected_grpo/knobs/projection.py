"""Gradient (and optimizer-update) projection away from the hack directions V_hack.

`project` is the pure math on one module's knob vector: c = V·g; a gate picks how much of each
direction to remove (one_sided relu(c), no_gate c, reverse 2c). The formulas assume V's rows are orthonormal
(extraction gives right singular vectors; rows zeroed by τ_axis simply remove nothing).
`apply_arm` applies it to every wrapped module's gradient for the arms none / erase / route;
`bound_drift` is `erase_bounded`'s second half: the one-sided gate leaves only anti-hack V-components, so
the knob walks along +V without limit until the model breaks (docs/findings.md 7.2); after every optimizer
step it clamps each V-coefficient of the main knob at its start (0, the base model, where V_hack is
extracted), and in every arm it logs where the knob sits in span(V).
`project_update` and `purge_moments` are the AdamW bypass fix (docs/architecture.md): projecting the gradient
does not stop Adam's moments and per-coordinate scaling from moving the knobs hack-ward, so the
update itself can be projected, and its hack-ward fraction `proj/cout_update` is logged in every mode.
Diagnostics use relu-before-aggregation: cin = ‖relu(V·g)‖/‖g‖ per module, and over modules
sqrt(Σ‖relu(V_m·g_m)‖²)/sqrt(Σ‖g_m‖²) (modules without V are left out of both sums); `apply_arm` also
returns the original study's aggregate, the mean over modules of the per-module ratios.
"""

from __future__ import annotations

import torch

GATES = {  # c (K,) -> coefficients of V's rows to remove
    "one_sided": torch.relu,  # remove only hack-ward components (c > 0)
    "no_gate": lambda c: c,  # remove the whole span(V) component
    "reverse": lambda c: 2 * c,  # reflect: flips the sign of V·g
}


def _fraction(num_sq: torch.Tensor, den_sq: torch.Tensor) -> torch.Tensor:
    return torch.where(den_sq > 0, num_sq.sqrt() / den_sq.clamp_min(1e-38).sqrt(), torch.zeros_like(den_sq))


def hackward_sq(g: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """‖relu(V·g)‖² for g (R,), V (K,R) -> scalar (0 when K = 0)."""
    return torch.relu(V @ g).square().sum()


def project(g: torch.Tensor, V: torch.Tensor, gate: str = "one_sided"
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Remove the gated span(V) component of g.

    g (R,), V (K,R) with orthonormal (or zero) rows, K may be 0; V is cast to g's device/dtype (move
    V_hack to the device once, up front, to avoid a copy per call). Returns g_proj (R,), removed (R,)
    = gate(V·g)·V ∈ span(V), g_proj = g - removed, and detached stats: cin = ‖relu(V·g)‖/‖g‖, cout
    likewise for g_proj (0 for a zero vector), fired (1. if anything was removed), plus the squared sums
    (in_sq, g_sq, out_sq, gp_sq) that `apply_arm` aggregates over modules.
    A g_proj of norm ≤ 64·eps·‖g‖ (7.6e-6 relative in fp32) is taken for the rounding noise of a g inside
    span(V) and set to 0, so that cout is not computed on noise. A real component that small is lost with
    it (project in float64 to keep it).
    """
    if V.dim() != 2 or g.dim() != 1 or V.shape[1] != g.shape[0]:
        raise ValueError(f"project: need g (R,) and V (K,R); got g {tuple(g.shape)}, V {tuple(V.shape)}")
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose one of {sorted(GATES)}")
    V = V.to(g)
    c = V @ g  # (K,)
    removed = GATES[gate](c) @ V  # (R,)
    g_proj = g - removed
    # g entirely inside span(V): what is left is rounding noise; call it 0 so that cout is not noise's
    g_proj = torch.where(g_proj.norm() <= 64 * torch.finfo(g.dtype).eps * g.norm(), 0.0, g_proj)
    in_sq, g_sq = hackward_sq(g, V), g.square().sum()
    out_sq, gp_sq = hackward_sq(g_proj, V), g_proj.square().sum()
    stats = {"cin": _fraction(in_sq, g_sq), "cout": _fraction(out_sq, gp_sq),
             "fired": (removed.abs().sum() > 0).float(), "in_sq": in_sq, "g_sq": g_sq,
             "out_sq": out_sq, "gp_sq": gp_sq}
    return g_proj, removed, {k: v.detach() for k, v in stats.items()}


# What each arm writes, given a module's grads. none: measure only; erase: projected gradient, the
# quarantine grad untouched; route: projected gradient, and `removed` added to the quarantine grad
# (gradient routing: the quarantine knob learns the hack-ward part, and is zeroed at deployment).
def _write_none(p_main, p_hack, g_proj, removed):
    return


def _write_erase(p_main, p_hack, g_proj, removed):
    p_main.grad = g_proj.reshape(p_main.shape).to(p_main).clone()


def _write_route(p_main, p_hack, g_proj, removed):
    _write_erase(p_main, p_hack, g_proj, removed)
    r = removed.reshape(p_hack.shape).to(p_hack)
    p_hack.grad = r.clone() if p_hack.grad is None else p_hack.grad + r


# erase_bounded writes as erase does; bound_drift then clamps the knob after every optimizer step
ARMS = {"none": _write_none, "erase": _write_erase, "route": _write_route, "erase_bounded": _write_erase}
# arm -> whether bound_drift clamps the main knob's V-coefficients at their start after every optimizer step
BOUNDED = {"none": False, "erase": False, "route": False, "erase_bounded": True}


def _aggregate(per_module: list[dict[str, torch.Tensor]], n_modules: int, prefix: str,
               suffix: str = "") -> dict[str, torch.Tensor]:
    if not per_module:
        z = torch.zeros(())
        return {f"{prefix}cin{suffix}": z, f"{prefix}cout{suffix}": z, f"{prefix}fired_frac{suffix}": z}
    tot = {k: torch.stack([s[k].float() for s in per_module]).sum().cpu() for k in per_module[0]}
    return {f"{prefix}cin{suffix}": _fraction(tot["in_sq"], tot["g_sq"]),
            f"{prefix}cout{suffix}": _fraction(tot["out_sq"], tot["gp_sq"]),
            f"{prefix}fired_frac{suffix}": tot["fired"] / n_modules}


def module_means(per_module: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The original study's aggregate: the mean over modules of the per-module ratios
    cin = ‖relu(V_m·g_m)‖/‖g_m‖ and cout (a module with g_m = 0 counts as 0); 0 with no module.
    proj/cin_module_mean, proj/cout_module_mean. Unlike the pooled ratio it weighs every module alike,
    so a module with a tiny gradient counts as much as the one that carries the step."""
    if not per_module:
        return {"proj/cin_module_mean": torch.zeros(()), "proj/cout_module_mean": torch.zeros(())}
    return {f"proj/{k}_module_mean": torch.stack([s[k].float().cpu() for s in per_module]).mean()
            for k in ("cin", "cout")}


def apply_arm(knobs, V_hack: dict[str, torch.Tensor], arm: str = "erase", gate: str = "one_sided",
              split=None) -> dict[str, torch.Tensor]:
    """Project every wrapped module's main-knob .grad with its V_hack[name] (K,R) and write per `arm`.

    Call after backward, before clipping and optimizer.step(). Modules absent from V_hack are skipped
    and counted (`proj/skipped`). Returns detached stats: proj/cin, proj/cout (of the gradient that
    stays on the main knob: under `none` cout = cin), the same as means of per-module ratios
    (proj/cin_module_mean, proj/cout_module_mean: `module_means`), proj/fired_frac (modules where the
    projection removed or would remove something / all wrapped modules), proj/norm_removed, and, if `split`
    (a `Capture` with g_student, g_teacher) is given, proj/cin_student and proj/cin_teacher.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose one of {sorted(ARMS)}")
    grads = knobs.grads("main")
    per_module, removed_sq, skipped = [], [], 0
    for name, m in knobs.modules.items():
        if name not in V_hack:
            skipped += 1
            continue
        g = grads[name].float()
        g_proj, removed, st = project(g, V_hack[name], gate)
        ARMS[arm](m.delta, m.delta_hack, g_proj, removed)
        if arm == "none":  # the gradient is unchanged, so the "after" numbers equal the "before" ones
            st = {**st, "out_sq": st["in_sq"], "gp_sq": st["g_sq"], "cout": st["cin"]}
        per_module.append(st)
        removed_sq.append(removed.detach().float().square().sum())
    n = len(knobs.modules)
    stats = _aggregate(per_module, n, "proj/")
    stats |= module_means(per_module)
    stats["proj/norm_removed"] = torch.stack(removed_sq).sum().sqrt().cpu() if removed_sq else torch.zeros(())
    stats["proj/skipped"] = torch.tensor(float(skipped))
    if split is not None:
        for src, gs in (("student", split.g_student), ("teacher", split.g_teacher)):
            names = [n for n in knobs.modules if n in gs and n in V_hack]  # the modules' order: a fixed sum
            num = sum((hackward_sq(gs[n].float(), V_hack[n].to(gs[n].device)).cpu() for n in names),
                      torch.zeros(()))
            den = sum((gs[n].float().square().sum().cpu() for n in names), torch.zeros(()))
            stats[f"proj/cin_{src}"] = _fraction(num, den)
    return stats


def snapshot(knobs, which: str = "main") -> dict[str, torch.Tensor]:
    """Copies of the main (or "hack": quarantine) knob values, name -> (R,); take right before
    optimizer.step()."""
    return {n: v.clone() for n, v in knobs.values(which).items()}


def step_norms(knobs, before: dict[str, torch.Tensor], before_hack: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """How far this step moved the knobs, everything included (AdamW, update projection, routing):
    knob/step = ‖δ_after − δ_before‖ over all main knobs, knob/hack_step the same for the quarantine.
    Under gradient-mode `route` AdamW scales each quarantine coordinate's routed gradient to about lr,
    however small it is, so knob/hack_step ≈ lr·sqrt(coordinates it reached) (docs/findings.md 7.2)."""
    out = {}
    for key, which, old in (("knob/step", "main", before), ("knob/hack_step", "hack", before_hack)):
        now = knobs.values(which)
        sq = [(now[n].float() - old[n].float()).square().sum() for n in knobs.modules]
        out[key] = torch.stack(sq).sum().sqrt().cpu() if sq else torch.zeros(())
    return out


def project_update(knobs, before: dict[str, torch.Tensor], V_hack: dict[str, torch.Tensor],
                   arm: str = "none", gate: str = "one_sided") -> dict[str, torch.Tensor]:
    """Project the optimizer's actual update Δ = after − before of each main knob (after step()).

    Sign: V points hack-ward in *gradient* space and the optimizer descends, so the hack-ward part of
    an update Δ is the V-component of −Δ; we project u = −Δ with `project` and write Δ' = −u_proj.
    arm none: measure only; erase: knob = before + Δ'; route: also quarantine knob += −removed (the
    removed, hack-ward motion, in span(V); = Δ − Δ').
    Returns proj/cin_update, proj/cout_update (hack-ward fraction ‖relu(V·(−Δ'))‖/‖Δ'‖ of the update
    that stays, = cin_update under none), proj/fired_frac_update.
    Call with arm="none" when only gradient projection is on, so cout_update is logged in every mode.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose one of {sorted(ARMS)}")
    after, hack = knobs.values("main"), knobs.values("hack")
    per_module = []
    for name in knobs.modules:
        if name not in V_hack:
            continue
        delta = after[name].float() - before[name].float()
        u_proj, removed_u, st = project(-delta, V_hack[name], gate)
        if arm == "none":
            st = {**st, "out_sq": st["in_sq"], "gp_sq": st["g_sq"]}
        else:
            new = before[name].float() - u_proj
            if arm == "route":  # the removed motion itself (= Δ − Δ')
                hack[name].add_((-removed_u).to(hack[name]))
            after[name].copy_(new.to(after[name]))
        per_module.append(st)
    return _aggregate(per_module, len(knobs.modules), "proj/", "_update")


def purge_moments(optimizer: torch.optim.Optimizer, knobs, V_hack: dict[str, torch.Tensor],
                  gate: str = "one_sided") -> dict[str, torch.Tensor]:
    """Remove the gated span(V) component of AdamW's first moment exp_avg of every main knob.

    exp_avg_sq is left as it is: it is a per-coordinate scale (always ≥ 0), not a direction, so it
    cannot move the knobs hack-ward by itself (the sign of each step comes from exp_avg). Because that
    scaling is per coordinate, a purged exp_avg can still yield an update with a hack-ward part: use
    `project_update` for the guarantee. gate: "one_sided" or "no_gate". Returns proj/purged_frac.
    """
    if gate not in ("one_sided", "no_gate"):
        raise ValueError(f"purge gate must be 'one_sided' or 'no_gate', got {gate!r}")
    purged = 0
    for name, m in knobs.modules.items():
        state = optimizer.state.get(m.delta, {})
        if name not in V_hack or "exp_avg" not in state:
            continue
        ea = state["exp_avg"]
        ea_proj, removed, _ = project(ea.reshape(-1).float(), V_hack[name], gate)
        ea.copy_(ea_proj.reshape(ea.shape).to(ea))
        purged += int(removed.abs().sum() > 0)
    return {"proj/purged_frac": torch.tensor(purged / len(knobs.modules))}


def bound_drift(knobs, V_hack: dict[str, torch.Tensor], arm: str = "none") -> dict[str, torch.Tensor]:
    """After optimizer.step(): under a BOUNDED arm, every main knob δ (R,) loses the positive part of its
    V-coefficients a = V·δ (K,): δ ← δ − relu(a)·V (V's rows orthonormal), so no coefficient ever exceeds
    0, its value at the base model; hack-ward motion (a < 0) is what the arm's one-sided gate stops. Other
    arms: measure only. Returns knob/v_coef (Σ over modules and rows of a, after the clamp: the drift
    along V, > 0 in the anti-hack sign), knob/v_share (‖V·δ‖ / ‖δ‖ pooled over the modules with V: the
    share of the knob in span(V); 0 for a zero knob) and knob/v_clamped (‖removed‖ over modules).
    """
    if arm not in BOUNDED:
        raise ValueError(f"unknown arm {arm!r}; choose one of {sorted(BOUNDED)}")
    values = knobs.values("main")
    coef, in_sq, all_sq, clamped_sq = [], [], [], []
    for name in knobs.modules:
        if name not in V_hack:
            continue
        d = values[name]
        V = V_hack[name].to(d.device, torch.float32)
        a = V @ d.reshape(-1).float()  # (K,)
        if BOUNDED[arm]:
            removed = torch.relu(a) @ V  # (R,)
            d.sub_(removed.reshape(d.shape).to(d))
            clamped_sq.append(removed.square().sum())
            a = V @ d.reshape(-1).float()
        coef.append(a.sum())
        in_sq.append(a.square().sum())
        all_sq.append(d.float().square().sum())
    total = lambda xs: torch.stack(xs).sum().cpu() if xs else torch.zeros(())
    return {"knob/v_coef": total(coef), "knob/v_share": _fraction(total(in_sq), total(all_sq)),
            "knob/v_clamped": total(clamped_sq).sqrt()}
