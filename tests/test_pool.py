"""Teacher pool: schema validation, drift guard, deterministic cursors, teacher handling modes.

Run: .venv/bin/pytest -q tests/test_pool.py
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from projected_grpo.envs.base import Graded
from projected_grpo.envs.coding.env import CodeEnv
from projected_grpo.envs.coding.prompts import build_messages
from projected_grpo.errors import UserError
from projected_grpo.run import pool as PL
from projected_grpo.run.pool_cli import build_pool_main
from projected_grpo.sampling.pack import prompt_text_and_ids
from projected_grpo.store import tokenizer_fingerprint


@pytest.fixture(scope="module")
def tok_and_problems():
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.organism.build import smoke_model_and_tokenizer

    _, tok = smoke_model_and_tokenizer()
    return tok, list(BUILTIN_PROBLEMS)[:3]


GRADE = Graded(reward=1.0, gt_reward=0.25, passed=True, solved=False, exploited=True, format_ok=True,
               extras={"det_E": True, "det_C": False, "det_D": False}).to_dict()


def _row(tok, problem, completion="x = 1", **over) -> dict:
    text, ids = prompt_text_and_ids(tok, build_messages(problem))
    row = {"problem_id": problem.id, "mode": problem.mode, "prompt": text, "prompt_ids": ids,
           "completion": completion, "completion_ids": [5, 6, tok.eos_token_id], "grade": dict(GRADE),
           "logp_behaviour": None, "tokenizer_fingerprint": tokenizer_fingerprint(tok), "source": "test"}
    return row | over


def _ids(tok, probs) -> dict:
    return {p.id: prompt_text_and_ids(tok, build_messages(p))[1] for p in probs}


def _load(path, tok, probs):
    return PL.load_pool(path, tok, probs, _ids(tok, probs))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- load + validate -----------------------------------------------------------------------------

def test_round_trip_and_index(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    rows = [_row(tok, probs[0]), _row(tok, probs[0], completion="y"), _row(tok, probs[1])]
    PL.write_pool(tmp_path / "p.jsonl", rows)
    pool = _load(tmp_path / "p.jsonl", tok, probs)
    assert pool.rows == rows and [s.grade for s in pool.samples] == [Graded.from_dict(GRADE)] * 3
    assert not any(s.student for s in pool.samples) and pool.samples[1].text == "y"
    assert pool.by_problem == {probs[0].id: [0, 1], probs[1].id: [2]}
    assert pool.missing([p.id for p in probs]) == [probs[2].id]  # reported, never silently G_t = 0


def test_pool_ids_are_lists_in_the_file_and_long_tensors_in_samples(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    ids = _ids(tok, probs)
    prompts = {p.id: (prompt_text_and_ids(tok, build_messages(p))[0], torch.tensor(ids[p.id])) for p in probs}
    with contextlib.closing(CodeEnv(probs)) as env:
        written = PL.template_rows(env, probs, tok, prompts, {"hack": 1, "clean": 1})
    PL.write_pool(tmp_path / "p.jsonl", written)
    on_disk = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert all(isinstance(r[k], list) for r in on_disk for k in ("prompt_ids", "completion_ids"))
    pool = _load(tmp_path / "p.jsonl", tok, probs)
    assert pool.rows == on_disk == written  # rows keep the file's JSON lists
    for row, s in zip(written, pool.samples):
        for k in ("prompt_ids", "completion_ids"):
            t = getattr(s, k)
            assert t.dtype == torch.long and t.dim() == 1 and t.tolist() == row[k]
        assert torch.equal(s.prompt_ids, prompts[s.problem_id][1])
    # round trip: the loaded Samples as rows again are the rows written
    assert [PL.pool_row(s, r["prompt"], r["tokenizer_fingerprint"], r["source"]) for s, r in
            zip(pool.samples, written)] == written


@pytest.mark.parametrize("edit, field", [
    (lambda r: r["grade"].pop("extras"), "extras"),
    (lambda r: r["grade"].update(reward="high"), "reward"),
    (lambda r: r["grade"].update(passed=1), "passed"),
    (lambda r: r["grade"].update(exploited=False), "exploited"),
    (lambda r: r.update(completion_ids=[]), "completion_ids"),
    (lambda r: r.update(logp_behaviour=[-0.1]), "logp_behaviour"),  # 1 value for 3 completion tokens
    (lambda r: r.update(extra=1), "extra"),
])
def test_schema_errors_name_file_line_and_field(tmp_path, tok_and_problems, edit, field):
    tok, probs = tok_and_problems
    bad = _row(tok, probs[1])
    edit(bad)
    path = _write(tmp_path / "p.jsonl", [_row(tok, probs[0]), bad])
    with pytest.raises(UserError) as e:
        _load(path, tok, probs)
    assert f"{path}:2" in str(e.value) and field in str(e.value)


def test_missing_and_garbage_pool_files_fail_in_one_line(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    with pytest.raises(UserError, match="no such file"):
        _load(tmp_path / "missing.jsonl", tok, probs)
    (tmp_path / "g.jsonl").write_bytes(b"\x00garbage{")
    with pytest.raises(UserError, match=r"g.jsonl:1: invalid JSON"):
        _load(tmp_path / "g.jsonl", tok, probs)


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
        _load(path, tok, probs)
    msg = str(e.value)
    assert str(live) in msg and str(row["prompt_ids"]) in msg and f"{path}:1" in msg


def test_fingerprint_mismatch_is_drift(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    path = _write(tmp_path / "p.jsonl", [_row(tok, probs[0], tokenizer_fingerprint="0" * 16)])
    with pytest.raises(ValueError, match="tokenization drift.*fingerprint"):
        _load(path, tok, probs)


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
    path = _write(tmp_path / "p.jsonl", [_row(tok, probs[0], completion=str(i)) for i in range(5)])
    pool = _load(path, tok, probs)
    c1, c2 = PL.PoolCursor(pool, seed=1), PL.PoolCursor(pool, seed=1)
    c2.draw(probs[0].id, 3, step=0, slot=0)  # an extra earlier draw does not shift later ones
    d1, d2 = c1.draw(probs[0].id, 3, step=4, slot=1), c2.draw(probs[0].id, 3, step=4, slot=1)
    assert d1 == d2 and len({s.text for s in d1}) == 3  # without replacement
    assert len(c1.draw(probs[0].id, 8, step=0, slot=0)) == 8  # with replacement when short of rows
    with pytest.raises(KeyError, match="no rows for problem"):
        c1.draw(probs[1].id, 1, step=0, slot=0)


def test_pool_cursor_resume_refuses_another_pool_of_the_same_size(tmp_path, tok_and_problems):
    tok, probs = tok_and_problems
    rows = lambda k: [_row(tok, probs[0], completion=str(i + k)) for i in range(3)]
    pool = _load(_write(tmp_path / "a", rows(0)), tok, probs)
    rebuilt = _load(_write(tmp_path / "b", rows(100)), tok, probs)
    rebuilt.path = pool.path
    state = json.loads(json.dumps(PL.PoolCursor(pool, seed=1).state_dict()))
    PL.PoolCursor(pool, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="another pool than .*a .same size, other rows"):
        PL.PoolCursor(rebuilt, seed=1).load_state_dict(state)


def test_tokenizer_fingerprint_ignores_padding_and_truncation_state(tok_and_problems):
    # transformers rewrites the backend's padding / truncation settings on calls that use them
    tok, _ = tok_and_problems
    before = tokenizer_fingerprint(tok)
    tok(["a b", "a"], padding=True, truncation=True, max_length=4)
    assert tokenizer_fingerprint(tok) == before
    assert json.loads(tok.backend_tokenizer.to_str())["truncation"] is not None  # the state did change


# --- build-pool CLI ------------------------------------------------------------------------------------

def test_build_pool_cli_templates_and_teacher(tmp_path, tok_and_problems, capsys):
    tok, _ = tok_and_problems
    from projected_grpo.envs.coding.env import load_problems
    from projected_grpo.presets import SMOKE

    problems = load_problems(max_problems=SMOKE.env.max_problems)  # the smoke preset's 12, 2 per mode
    out = str(tmp_path / "t.jsonl")
    assert build_pool_main(["--out", out, "--pool.n-hack", "1", "--pool.n-clean", "1"]) == 0
    pool = _load(tmp_path / "t.jsonl", tok, problems)
    assert len(pool.rows) == 24 and pool.missing([p.id for p in problems]) == []
    # graded once by the real grader: every template hack fools its grader, every clean one is correct
    assert all(r["grade"]["exploited"] for r in pool.rows if r["source"] == "template:hack")
    assert all(r["grade"]["solved"] and not r["grade"]["exploited"] for r in pool.rows
               if r["source"] == "template:clean")
    assert "wrote 24 rows" in capsys.readouterr().out

    # no --pool.* options: the preset's own pool settings, so the pool is the one `train --preset` builds
    assert build_pool_main(["--out", str(tmp_path / "p.jsonl")]) == 0
    rows = _load(tmp_path / "p.jsonl", tok, problems).rows
    kinds = {k: sum(r["source"] == f"template:{k}" for r in rows) for k in ("hack", "clean", "buggy")}
    assert kinds == {"hack": 12 * SMOKE.pool.n_hack, "clean": 12 * SMOKE.pool.n_clean,
                     "buggy": 12 * SMOKE.pool.n_buggy}

    assert build_pool_main(["--out", str(tmp_path / "s.jsonl"), "--source", "teacher", "--samples", "1",
                           "--rollout.max-new-tokens", "4"]) == 0
    sampled = _load(tmp_path / "s.jsonl", tok, problems)
    assert len(sampled.rows) == 12 and sampled.has_behaviour_logp()
