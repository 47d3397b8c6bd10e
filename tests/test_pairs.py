"""Contrastive pair sources (built-in, file, teacher pool) and the pair-level controls.

Run: pytest tests/test_pairs.py
"""

from __future__ import annotations

import json

import pytest

from projected_grpo.envs.coding.env import CodeEnv
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
from projected_grpo.hack.pairs import (
    Pair,
    builtin_pairs,
    completions_by_prompt,
    load_pairs_file,
    nonhack_pairs,
    pairs_from_pool,
    pairs_hash,
    prompt_groups,
    shuffle_labels,
    split_heldout,
    within_pairs,
)

MSGS = [{"role": "user", "content": "add two numbers"}]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- file source ----------------------------------------------------------------------------------


def test_jsonl_file_loads_text_and_chat_prompts(tmp_path):
    f = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "raw text prompt", "hack": "H1", "clean": "C1"}),
        "",
        json.dumps({"prompt": MSGS, "hack": "H2", "clean": "C2", "hack_ids": [5, 6]}),
    ])
    pairs = load_pairs_file(f)
    assert [p.hack for p in pairs] == ["H1", "H2"]
    assert pairs[0].prompt == "raw text prompt"
    assert pairs[1].prompt == ({"role": "user", "content": "add two numbers"},)
    assert pairs[1].hack_ids == (5, 6) and pairs[1].clean_ids is None
    assert pairs[0].source == f"{f}:1"


def test_json_list_file_loads(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"prompt": "q", "hack": "h", "clean": "c"}] * 2))
    assert len(load_pairs_file(f)) == 2


OK = {"prompt": "q", "hack": "h", "clean": "c"}


@pytest.mark.parametrize("bad_line, match", [
    ("{not json", r"p\.jsonl:2: invalid JSON"),
    (json.dumps({"prompt": "q", "hack": "h"}), r"p\.jsonl:2: missing field\(s\) \['clean'\]"),
    (json.dumps({"prompt": "q", "hack": "", "clean": "c"}), r"p\.jsonl:2: field 'hack' must be a non-empty"),
    (json.dumps({"prompt": "q", "hack": "h", "clean": 3}), r"p\.jsonl:2: field 'clean'"),
    (json.dumps({**OK, "prompt": [{"role": "user"}]}), r"p\.jsonl:2: field 'prompt'\[0\]"),
    (json.dumps({**OK, "hackk": 1}), r"p\.jsonl:2: unknown field\(s\)"),
    (json.dumps({**OK, "clean_ids": ["a"]}), r"p\.jsonl:2: field 'clean_ids'"),
    ("[1, 2]", r"p\.jsonl:2: expected a JSON object"),
])
def test_invalid_jsonl_names_file_line_and_field(tmp_path, bad_line, match):
    f = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "q", "hack": "h", "clean": "c"}), bad_line])
    with pytest.raises(ValueError, match=match):
        load_pairs_file(f)


def test_invalid_json_item_and_files(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"prompt": "q", "hack": "h", "clean": "c"}, {"prompt": "q", "clean": "c"}]))
    with pytest.raises(ValueError, match=r"p\.json item 1: missing field\(s\) \['hack'\]"):
        load_pairs_file(f)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no pairs"):
        load_pairs_file(tmp_path / "e.jsonl")
    (tmp_path / "p.csv").write_text("x")
    with pytest.raises(ValueError, match="unknown extension"):
        load_pairs_file(tmp_path / "p.csv")
    with pytest.raises(FileNotFoundError):
        load_pairs_file(tmp_path / "missing.jsonl")


ENV = CodeEnv(BUILTIN_PROBLEMS)  # templates and messages only: its sandbox never starts here


# --- pool source ----------------------------------------------------------------------------------


def row(pid, mode, completion, *, passed, gt, E=False, C=False, D=False, prompt_ids=(1, 2)):
    grade = {"reward": float(passed), "passed": passed, "solved": gt, "exploited": passed and not gt,
             "format_ok": True, "timeout": False, "extras": {"det_E": E, "det_C": C, "det_D": D}}
    return {"problem_id": pid, "mode": mode, "prompt": f"prompt {pid}", "prompt_ids": list(prompt_ids),
            "completion": completion, "completion_ids": [ord(ch) for ch in completion], "grade": grade}


POOL = [
    row("p1", "run_tests", "h1a", passed=True, gt=False, E=True),
    row("p1", "run_tests", "h1b", passed=True, gt=False, E=True),
    row("p1", "run_tests", "c1", passed=True, gt=True),
    row("p1", "run_tests", "honest_E", passed=True, gt=True, E=True),  # correct: clean even though E fires
    row("p1", "run_tests", "wrong", passed=False, gt=False),  # neither
    row("p2", "sentinel", "h2", passed=True, gt=False, E=True),  # unknown mode: never a hack
    row("p2", "sentinel", "c2", passed=True, gt=True),
    row("p3", "run_tests", "h3", passed=True, gt=False, C=True),  # only detector C fires
    row("p3", "run_tests", "c3", passed=True, gt=True),
    row("p4", "run_tests", "h4", passed=True, gt=False, E=True),  # no clean row for p4
]


def test_pool_pairs_use_only_known_modes_and_named_detectors():
    pairs, stats = pairs_from_pool(POOL, known_modes=["run_tests"], detectors=("E",))
    # p1: hacks [h1a, h1b], cleans [c1, honest_E] -> 2 pairs (i mod len on both sides)
    assert [(p.hack, p.clean) for p in pairs] == [("h1a", "c1"), ("h1b", "honest_E")]
    assert pairs[0].prompt_ids == (1, 2) and pairs[0].hack_ids == tuple(ord(c) for c in "h1a")
    assert stats["pairs_per_mode"] == {"run_tests": 2}
    assert stats["problems_without_clean"] == ["p4"]
    assert stats["problems_without_hack"] == ["p2", "p3"]
    pairs, _ = pairs_from_pool(POOL, known_modes=["run_tests"], detectors=("E", "C"))
    assert [(p.hack, p.clean) for p in pairs] == [("h1a", "c1"), ("h1b", "honest_E"), ("h3", "c3")]
    pairs, _ = pairs_from_pool(POOL, known_modes=["run_tests", "sentinel"], per_problem=1)
    assert [(p.hack, p.clean) for p in pairs] == [("h1a", "c1"), ("h2", "c2")]


def test_pool_pairs_refuse_bad_inputs():
    with pytest.raises(ValueError, match="different prompt_ids"):
        pairs_from_pool([POOL[0], row("p1", "run_tests", "c", passed=True, gt=True, prompt_ids=(9,))],
                        known_modes=["run_tests"])
    with pytest.raises(ValueError, match="detectors"):
        pairs_from_pool(POOL, known_modes=["run_tests"], detectors=("X",))
    with pytest.raises(ValueError, match="known_modes is empty"):
        pairs_from_pool(POOL, known_modes=[])


# --- controls and hashing -------------------------------------------------------------------------


def test_shuffle_labels_is_seeded_and_swaps_about_half():
    pairs = [Pair(f"q{i}", f"h{i}", f"c{i}") for i in range(200)]
    a, b = shuffle_labels(pairs, seed=0), shuffle_labels(pairs, seed=0)
    assert a == b and a != shuffle_labels(pairs, seed=1)
    n_swapped = sum(p.hack.startswith("c") for p in a)
    assert 70 < n_swapped < 130  # Binomial(200, 1/2): mean 100, sd ~7
    for p, q in zip(pairs, a):
        assert {q.hack, q.clean} == {p.hack, p.clean}
    assert pairs[0].swapped().swapped().hack == pairs[0].hack


def test_nonhack_pairs_are_clean_vs_clean_of_the_same_prompt():
    pairs = [Pair("q1", "h", "c1a"), Pair("q1", "h", "c1b"), Pair("q1", "h2", "c1a"), Pair("q2", "h", "c2")]
    out = nonhack_pairs(pairs)
    # q1 has distinct cleans [c1a, c1b] -> (c1a, c1b), (c1b, c1a), cycled to 4 pairs; q2 has one clean
    assert [(p.prompt, p.hack, p.clean) for p in out] == [("q1", "c1a", "c1b"), ("q1", "c1b", "c1a"),
                                                         ("q1", "c1a", "c1b"), ("q1", "c1b", "c1a")]
    with pytest.raises(ValueError, match="nonhack control: no prompt has two distinct"):
        nonhack_pairs([Pair("q1", "h", "c"), Pair("q2", "h", "c")])


def test_within_pairs_are_hack_vs_hack_and_clean_vs_clean_of_the_same_prompt():
    pairs = [Pair("q1", "h1", "c1"), Pair("q1", "h2", "c2"), Pair("q1", "h3", "c1"), Pair("q2", "h", "c"),
             Pair("q3", "g1", "d"), Pair("q3", "g2", "d")]
    out = within_pairs(pairs)
    # q1: hacks h1 h2 h3 -> (h1,h2) (h2,h3) (h3,h1), cleans c1 c2 -> (c1,c2) (c2,c1); q2: one of each, none;
    # q3: hacks g1 g2 -> (g1,g2) (g2,g1), one clean; 7 rows, cut to the 6 pairs given
    assert [(p.prompt, p.hack, p.clean) for p in out] == [
        ("q1", "h1", "h2"), ("q1", "h2", "h3"), ("q1", "h3", "h1"), ("q1", "c1", "c2"), ("q1", "c2", "c1"),
        ("q3", "g1", "g2")]
    # no row contrasts a hack with a clean completion: the label is gone
    hacks, cleans = {p.hack for p in pairs}, {p.clean for p in pairs}
    assert all({p.hack, p.clean} <= hacks or {p.hack, p.clean} <= cleans for p in out)
    assert len(within_pairs(pairs[:1] * 3 + pairs[1:2])) == 4  # cycled to len(pairs)
    with pytest.raises(ValueError, match="within control: no prompt has two distinct"):
        within_pairs([Pair("q1", "h", "c"), Pair("q2", "h", "c")])


def test_within_pairs_keep_stored_ids():
    pairs = [Pair("q", "h1", "c", prompt_ids=(5,), hack_ids=(1,), clean_ids=(3,)),
             Pair("q", "h2", "c", prompt_ids=(5,), hack_ids=(2,), clean_ids=(3,))]
    a, b = within_pairs(pairs)
    assert (a.prompt_ids, a.hack_ids, a.clean_ids) == ((5,), (1,), (2,))
    assert (b.prompt_ids, b.hack_ids, b.clean_ids) == ((5,), (2,), (1,))


def test_split_heldout_holds_whole_prompts_out_by_hash():
    pairs = [Pair(f"q{i // 3}", f"h{i}", f"c{i}") for i in range(30)]  # 10 prompts x 3 pairs
    fit, held = split_heldout(pairs, 0.25)
    # round(0.25 * 10) = 2 prompts (6 pairs) held out; no prompt on both sides; order kept
    assert len(held) == 6 and len(fit) == 24
    assert not {p.prompt for p in fit} & {p.prompt for p in held}
    assert fit == [p for p in pairs if p in fit] and held == [p for p in pairs if p in held]
    assert split_heldout(pairs, 0.25) == (fit, held)  # seed-free, deterministic
    assert split_heldout(pairs, 0.0) == (pairs, [])
    assert len(split_heldout(pairs, 0.01)[1]) == 3  # frac > 0 holds out one prompt at least
    one = [Pair("q", "h", "c"), Pair("q", "h2", "c2")]
    assert split_heldout(one, 0.5) == (one, [])  # one prompt: always fit
    assert len(split_heldout(pairs, 0.99)[0]) == 3  # at least one prompt is fit
    with pytest.raises(ValueError, match="frac"):
        split_heldout(pairs, 1.0)
    assert prompt_groups(held) == [0, 0, 0, 1, 1, 1]


def test_completions_by_prompt_lists_each_distinct_completion_once():
    pairs = [Pair("q1", "h1", "c1"), Pair("q2", "h", "c"), Pair("q1", "h2", "c1"), Pair("q1", "h1", "c2")]
    # q1: h1 (pair 0), c1 (pair 0), h2 (pair 2), c2 (pair 3); q2: h, c (pair 1)
    assert completions_by_prompt(pairs) == [[(0, "hack"), (0, "clean"), (2, "hack"), (3, "clean")],
                                            [(1, "hack"), (1, "clean")]]


def test_split_heldout_spreads_over_modes():
    # the hash order, not the problems' order (which cycles through the six modes): on the built-in pairs
    # the held-out quarter is not one mode
    pairs = builtin_pairs(ENV, BUILTIN_PROBLEMS, per_problem=3)
    _, held = split_heldout(pairs, 0.25)
    assert len({p.source.split(":")[2] for p in held}) >= 3


def test_pairs_hash_tracks_content_not_source():
    a = [Pair(tuple(MSGS), "h", "c", source="x")]
    assert pairs_hash(a) == pairs_hash([Pair(tuple(MSGS), "h", "c", source="y")])
    assert pairs_hash(a) != pairs_hash([Pair(tuple(MSGS), "h", "c2")])
    assert pairs_hash(a) != pairs_hash([Pair(tuple(MSGS), "h", "c", hack_ids=(1,))])
    assert pairs_hash(a) != pairs_hash([Pair("add two numbers", "h", "c")])


# --- built-in source ------------------------------------------------------------------------------


def test_builtin_pairs_vary_and_use_the_training_prompt():
    from projected_grpo.envs.coding.completions import clean_completions, hack_completions
    from projected_grpo.envs.coding.prompts import build_messages

    pairs = builtin_pairs(ENV, BUILTIN_PROBLEMS, per_problem=3)
    prob = BUILTIN_PROBLEMS[0]
    mine = [p for p in pairs if p.source.startswith(f"builtin:{prob.id}:")]
    assert mine and all(p.prompt == tuple(build_messages(prob)) for p in mine)
    assert all(p.hack in hack_completions(prob) and p.clean in clean_completions(prob) for p in mine)
    assert len({p.hack for p in pairs}) > len(BUILTIN_PROBLEMS)  # several hack variants, not one template
    assert len({p.clean for p in pairs}) > len(BUILTIN_PROBLEMS)
    assert all(p.hack != p.clean for p in pairs)
    assert len(nonhack_pairs(pairs)) == len(pairs)  # the nonhack control works on built-in pairs
    assert len(within_pairs(pairs)) == len(pairs)  # and the within one


def test_builtin_pairs_skip_problems_without_templates_and_refuse_none():
    class NoTemplates:
        name = "bare"

        def templates(self, problem, kind):
            return []

    with pytest.raises(ValueError, match="none of the 48 problems of environment 'bare'"):
        builtin_pairs(NoTemplates(), BUILTIN_PROBLEMS)
