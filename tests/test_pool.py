"""Teacher pool: schema validation, drift guard, deterministic cursors, teacher handling modes.

Run: .venv/bin/pytest -q tests/test_pool.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.losses import clip_surrogate
from projected_grpo.run import pool as PL
from projected_grpo.run.pool_cli import build_pool_main
from projected_grpo.store import tokenizer_fingerprint


@pytest.fixture(scope="module")
def tok_and_problems():
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.organism.build import smoke_model_and_tokenizer

    _, tok = smoke_model_and_tokenizer()
    return tok, list(BUILTIN_PROBLEMS)[:3]


def _row(tok, problem, completion="x = 1", **over) -> dict:
    text, ids = PL.prompt_text_and_ids(tok, problem)
    row = {"problem_id": problem.id, "mode": problem.mode, "prompt": text, "prompt_ids": ids,
           "completion": completion, "completion_ids": [5, 6, tok.eos_token_id], "reward": 1.0,
           "passed": True, "gt_correct": False, "exploited": True, "format_ok": True, "det_E": True,
           "det_C": False, "det_D": False, "logp_behaviour": None,
           "tokenizer_fingerprint": tokenizer_fingerprint(tok), "source": "test"}
    return row | over


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- load + validate -----------------------------------------------------------------------------

def test_round_trip_and_index(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    rows = [_row(tok, probs[0]), _row(tok, probs[0], completion="y"), _row(tok, probs[1])]
    PL.write_pool(tmp_path / "p.jsonl", rows)
    pool = PL.load_pool(tmp_path / "p.jsonl", tok, probs)
    assert pool.rows == rows
    assert pool.by_problem == {probs[0].id: [0, 1], probs[1].id: [2]}
    assert pool.missing([p.id for p in probs]) == [probs[2].id]  # reported, never silently G_t = 0


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("det_C"), "det_C"),
    (lambda r: r.update(reward="high"), "reward"),
    (lambda r: r.update(passed=1), "passed"),
    (lambda r: r.update(completion_ids=[]), "completion_ids"),
    (lambda r: r.update(logp_behaviour=[-0.1]), "logp_behaviour"),  # 1 value for 3 completion tokens
    (lambda r: r.update(extra=1), "extra"),
])
def test_schema_errors_name_file_line_and_field(tmp_path, tok_and_problems, edit, field):
    tok, probs = tok_and_problems
    bad = _row(tok, probs[1])
    edit(bad)
    path = _write(tmp_path / "p.jsonl", [_row(tok, probs[0]), bad])
    with pytest.raises(ValueError) as e:
        PL.load_pool(path, tok, probs)
    assert f"{path}:2" in str(e.value) and field in str(e.value)


def test_drift_guard_refuses_other_tokenisation_showing_both(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    row = _row(tok, probs[0])
    live = list(row["prompt_ids"])
    # Re-tokenise the prompt text piecewise (as if another tokenizer split it differently): same text,
    # other ids.
    other = [i for ch in row["prompt"][:20] for i in tok(ch, add_special_tokens=False)["input_ids"]]
    row["prompt_ids"] = other + live[len(tok(row["prompt"][:20], add_special_tokens=False)["input_ids"]):]
    assert row["prompt_ids"] != live
    path = _write(tmp_path / "p.jsonl", [row])
    with pytest.raises(ValueError, match="tokenization drift") as e:
        PL.load_pool(path, tok, probs)
    msg = str(e.value)
    assert str(live) in msg and str(row["prompt_ids"]) in msg and f"{path}:1" in msg


def test_fingerprint_mismatch_is_drift(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    path = _write(tmp_path / "p.jsonl", [_row(tok, probs[0], tokenizer_fingerprint="0" * 16)])
    with pytest.raises(ValueError, match="tokenization drift.*fingerprint"):
        PL.load_pool(path, tok, probs)


# --- cursors ---------------------------------------------------------------------------------------

def test_prompt_cursor_resumes_exactly():
    a = PL.PromptCursor(["p0", "p1", "p2", "p3", "p4"], seed=7)
    first = a.take(3) + a.take(4)  # crosses an epoch boundary (5 ids)
    assert sorted(first[:5]) == ["p0", "p1", "p2", "p3", "p4"]  # an epoch is a permutation
    state = a.state_dict()
    b = PL.PromptCursor(["p0", "p1", "p2", "p3", "p4"], seed=7)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert a.take(6) == b.take(6)
    with pytest.raises(ValueError, match="same config"):
        PL.PromptCursor(["p0"], seed=7).load_state_dict(state)


def test_pool_cursor_draws_depend_only_on_seed_step_problem_slot(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    rows = [_row(tok, probs[0], completion=str(i)) for i in range(5)]
    pool = PL.TeacherPool(rows=rows, path="mem")
    c1, c2 = PL.PoolCursor(pool, seed=1), PL.PoolCursor(pool, seed=1)
    c2.draw(probs[0].id, 3, step=0, slot=0)  # an extra earlier draw does not shift later ones
    d1, d2 = c1.draw(probs[0].id, 3, step=4, slot=1), c2.draw(probs[0].id, 3, step=4, slot=1)
    assert d1 == d2 and len({r["completion"] for r in d1}) == 3  # without replacement
    assert len(c1.draw(probs[0].id, 8, step=0, slot=0)) == 8  # with replacement when short of rows
    with pytest.raises(KeyError, match="no rows for problem"):
        c1.draw(probs[1].id, 1, step=0, slot=0)


def test_pool_cursor_resume_refuses_another_pool_of_the_same_size(tok_and_problems):
    tok, probs = tok_and_problems
    pool = PL.TeacherPool(rows=[_row(tok, probs[0], completion=str(i)) for i in range(3)], path="a")
    rebuilt = PL.TeacherPool(rows=[_row(tok, probs[0], completion=str(i + 100)) for i in range(3)], path="a")
    state = json.loads(json.dumps(PL.PoolCursor(pool, seed=1).state_dict()))
    PL.PoolCursor(pool, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="another pool than a .same size, other rows"):
        PL.PoolCursor(rebuilt, seed=1).load_state_dict(state)


def test_tokenizer_fingerprint_ignores_padding_and_truncation_state(tok_and_problems):
    # transformers rewrites the backend's padding / truncation settings on calls that use them
    tok, _ = tok_and_problems
    before = tokenizer_fingerprint(tok)
    tok(["a b", "a"], padding=True, truncation=True, max_length=4)
    assert tokenizer_fingerprint(tok) == before
    assert json.loads(tok.backend_tokenizer.to_str())["truncation"] is not None  # the state did change


# --- teacher handling (SPEC §3) --------------------------------------------------------------------

LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])  # row 0 student, row 1 teacher
LOGP_B = torch.tensor([[-1.0, -2.0], [-1.0, -0.1]])
IS_S = torch.tensor([True, False])
MASK = torch.ones(2, 2)


def test_imitation_forces_ratio_one():
    logp_old, w, stats = PL.TEACHER_MODES["imitation"](LOGP, LOGP_B, IS_S, MASK, 2.0)
    assert torch.equal(torch.exp(LOGP - logp_old), torch.ones(2, 2)) and torch.equal(w, torch.ones(2, 2))
    assert stats["teacher/mode"] == "imitation" and float(stats["teacher/ratio_mean"]) == 1.0


def test_importance_ratio_from_stored_logp_truncated():
    logp_old, w, stats = PL.TEACHER_MODES["importance"](LOGP, LOGP_B, IS_S, MASK, 1.2)
    # teacher tokens: rho = exp(-0.5 - -1.0) = exp(0.5) = 1.6487 -> truncated to 1.2;
    #                 rho = exp(-0.5 - -0.1) = exp(-0.4) = 0.6703 (kept). Student weights stay 1.
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [1.2, math.exp(-0.4)]]))
    ratio_mean = torch.tensor((math.exp(0.5) + math.exp(-0.4)) / 2)  # untruncated rho, over teacher tokens
    torch.testing.assert_close(stats["teacher/ratio_mean"], ratio_mean)
    assert float(stats["teacher/clip_frac"]) == 0.5  # 1 of the 2 teacher tokens truncated
    assert torch.equal(logp_old, LOGP)


def test_exclude_teacher_tokens_carry_no_gradient():
    logp = LOGP.clone().requires_grad_(True)
    logp_old, w, _ = PL.TEACHER_MODES["exclude"](logp, LOGP_B, IS_S, MASK, 2.0)
    loss_tok, _ = clip_surrogate(logp, logp_old, torch.tensor([1.0, -1.0]), MASK)
    (w * loss_tok).sum().backward()
    # on-policy (ratio 1): d(-r A)/dlogp = -A = -1 on the student row; teacher row weight 0
    assert torch.equal(logp.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 0), min_size=4, max_size=4), st.lists(st.floats(-5, 0), min_size=4, max_size=4),
       st.floats(1.0, 5.0))
def test_teacher_modes_leave_students_on_policy(lp, lb, trunc):
    logp, logp_b = torch.tensor(lp).reshape(2, 2), torch.tensor(lb).reshape(2, 2)
    for fn in PL.TEACHER_MODES.values():
        logp_old, w, _ = fn(logp, logp_b, IS_S, MASK, trunc)
        assert torch.equal(logp_old[0], logp[0]) and torch.equal(w[0], torch.ones(2))  # student row untouched
        assert (w >= 0).all() and (w <= max(trunc, 1.0)).all()


# --- build-pool CLI ------------------------------------------------------------------------------------

def test_build_pool_cli_templates_and_teacher(tmp_path, tok_and_problems, capsys):
    tok, _ = tok_and_problems
    from projected_grpo.presets import SMOKE
    from projected_grpo.run.train import load_problems

    problems = load_problems(SMOKE.env)  # the smoke preset's 12 problems, 2 per mode
    assert build_pool_main(["--out", str(tmp_path / "t.jsonl"), "--n-hack", "1", "--n-clean", "1"]) == 0
    pool = PL.load_pool(tmp_path / "t.jsonl", tok, problems)
    assert len(pool.rows) == 24 and pool.missing([p.id for p in problems]) == []
    # graded once by the real grader: every template hack fools its grader, every clean one is correct
    assert all(r["exploited"] for r in pool.rows if r["source"] == "template:hack")
    assert all(r["gt_correct"] and not r["exploited"] for r in pool.rows if r["source"] == "template:clean")
    assert "wrote 24 rows" in capsys.readouterr().out

    # no --n-* options: the preset's own pool settings, so the pool is the one `train --preset` builds
    assert build_pool_main(["--out", str(tmp_path / "p.jsonl")]) == 0
    rows = PL.load_pool(tmp_path / "p.jsonl", tok, problems).rows
    kinds = {k: sum(r["source"] == f"template:{k}" for r in rows) for k in ("hack", "clean", "buggy")}
    assert kinds == {"hack": 12 * SMOKE.pool.n_hack, "clean": 12 * SMOKE.pool.n_clean,
                     "buggy": 12 * SMOKE.pool.n_buggy}

    assert build_pool_main(["--out", str(tmp_path / "s.jsonl"), "--source", "teacher", "--samples", "1",
                           "--max-new-tokens", "4"]) == 0
    sampled = PL.load_pool(tmp_path / "s.jsonl", tok, problems)
    assert len(sampled.rows) == 12 and sampled.has_behaviour_logp()
    assert all(len(r["logp_behaviour"]) == len(r["completion_ids"]) <= 4 for r in sampled.rows)
