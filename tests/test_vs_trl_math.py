"""Our GRPO loss equals TRL's GRPOTrainer._compute_loss on identical inputs, for every loss type both define.

TRL is an optional `bench` extra: the whole module skips when it is not installed. The comparison code
(ours as train.py composes it; TRL's own `_compute_loss` on a bare trainer object) lives in
benchmarks/vs_trl.py, which prints the same table before timing the two trainers.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("trl")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"
_spec = importlib.util.spec_from_file_location("vs_trl", _PATH)
vs_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)


@pytest.mark.parametrize("seed", [0, 1])
def test_losses_and_gradients_match_trl(seed):
    rows = vs_trl.loss_check(seed=seed)
    # 4 shared loss types x beta {0, 0.04} x {1, 2} micro-batches
    assert {(r["loss"], r["beta"], r["n_micro"]) for r in rows} == {
        (lo, b, m) for lo in ("grpo", "bnpo", "dr_grpo", "dapo") for b in (0.0, 0.04) for m in (1, 2)}
    bad = [r for r in rows if not vs_trl.matches(r)]
    assert not bad, f"losses differ from TRL's: {bad}"


def test_check_can_fail_on_a_real_difference():
    # TRL's dr_grpo divides by rows x max_completion_length; tell TRL a different max length (8 vs our 6)
    # and the values must differ by the factor 6/8, which the check has to notice.
    x = vs_trl.loss_inputs(0)
    args = [x[k] for k in ("logp", "logp_old", "logp_ref", "adv", "mask")]
    kw = {"beta": 0.0, "G": 4, "n_micro": 1}
    ours = vs_trl.our_loss("dr_grpo", *args, max_new=6, **kw)
    trl = vs_trl.trl_loss("dr_grpo", *args, max_new=8, **kw)
    torch.testing.assert_close(trl, ours * 6 / 8)
    row = {"ours": float(ours), "trl": float(trl), "grad_max_diff": 0.0}
    assert not vs_trl.matches(row)


def test_hand_computed_dr_grpo_value():
    # One prompt, G = 2, max_new = 2; ratio 1 everywhere (logp_old = logp), beta = 0:
    # token loss = -adv per real token. Row 0: adv +1, 2 tokens; row 1: adv -1, 1 token.
    # sum = (-1 - 1) + (+1) = -1; denominator G * max_new * prompts = 2 * 2 * 1 = 4 -> -0.25 for both.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    for fn in (vs_trl.our_loss, vs_trl.trl_loss):
        v = fn("dr_grpo", logp, logp.clone(), logp.clone(), adv, mask, beta=0.0, G=2, max_new=2, n_micro=1)
        torch.testing.assert_close(v, torch.tensor(-0.25))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 3), G=st.integers(2, 5), T=st.integers(1, 8),
       loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"]), beta=st.sampled_from([0.0, 0.04, 1.0]),
       per_prompt_micro=st.booleans())
def test_property_equal_for_any_shape(seed, B, G, T, loss_type, beta, per_prompt_micro):
    # Invariant: for any B prompts x G samples x T tokens, ragged masks, and micro-batches of one prompt
    # each (our micro_prompts=1, TRL gradient accumulation over B) or none, the step losses agree.
    x = vs_trl.loss_inputs(seed, B=B, G=G, T=T)
    args = [x[k] for k in ("logp", "logp_old", "logp_ref", "adv", "mask")]
    kw = {"beta": beta, "G": G, "max_new": T, "n_micro": B if per_prompt_micro else 1}
    ours, trl = vs_trl.our_loss(loss_type, *args, **kw), vs_trl.trl_loss(loss_type, *args, **kw)
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-7)
