"""organism/maths.py and the generalised organism machinery: digit tokens, a corpus from any environment's
templates, the code organism's cache keys left as they were, the maths organism's build and checks, and
model.source = organism choosing the organism of env.name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.envs.base import Graded, RewardFnEnv
from projected_grpo.envs.maths.env import MathEnv
from projected_grpo.errors import UserError
from projected_grpo.organism import maths as M
from projected_grpo.organism.build import (
    ORGANISM_CODE_VERSION,
    SPECIAL_TOKENS,
    OrganismConfig,
    build_tokenizer,
    load_organism,
    organism_key,
)
from projected_grpo.organism.warmup import KINDS, builtin_corpus, env_corpus
from projected_grpo.run import setup
from projected_grpo.store import stable_hash

MATH_TEXTS = ["What is 37 + 5 * 120?", "37 + 600 = 637\n#### 637", "Ann has 12 pens."] * 3
# tiny sizes: a build takes about a second
TINY = M.MathsOrganismConfig(
    model=OrganismConfig(vocab_size=300, word_boundaries=False, hidden=16, layers=1, heads=2,
                         max_positions=256, mix=(0.5, 0.3, 0.2), per_problem=1, holdout_per_mode=0, steps=2,
                         batch_size=4),
    n_warmup=6, n_train=6)


# --- tokenizer: digits ------------------------------------------------------------------------------------

def test_split_digits_gives_every_digit_a_token_of_its_own(tmp_path):
    tok = build_tokenizer(MATH_TEXTS, vocab_size=300, word_boundaries=False, split_digits=True,
                          cache_dir=tmp_path)
    for text in MATH_TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text  # byte-level: exact
    # no vocabulary entry holds a digit beside anything else: "637" is three tokens
    assert all(len(t) == 1 for t in tok.get_vocab() if any(c.isdigit() for c in t))
    assert tok.tokenize("637") == ["6", "3", "7"]
    merged = build_tokenizer(MATH_TEXTS, vocab_size=300, word_boundaries=False, cache_dir=tmp_path)
    assert any(len(t) > 1 and any(c.isdigit() for c in t) for t in merged.get_vocab())  # e.g. "37"


def test_code_tokenizer_and_organism_keys_are_unchanged(tmp_path):
    # the keys as computed before split_digits, name_parts, formulas and the extras' hash existed, for a
    # config with no warm-up-only problems (the maths organism's): adding them must not move its key
    build_tokenizer(MATH_TEXTS, vocab_size=300, cache_dir=tmp_path)
    old_spec = {"texts": MATH_TEXTS, "vocab_size": 300, "word_boundaries": True, "special": SPECIAL_TOKENS,
                "code": ORGANISM_CODE_VERSION}
    assert [p.name for p in (tmp_path / "tokenizer").iterdir()] == [f"{stable_hash(old_spec)}.json"]
    corpus, cfg = builtin_corpus(), OrganismConfig(**M.CODE_ONLY_OFF)  # the fields' first values, no extras
    old_config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("name_parts", "formulas")}
    old_key = stable_hash({
        "config": old_config, "code": ORGANISM_CODE_VERSION,
        "problems": [[p.id, p.mode] for p in corpus.problems],
        "messages": [list(m) for m in corpus.messages],
        "completions": [{k: list(c[k]) for k in KINDS} for c in corpus.completions]})
    assert organism_key(cfg, corpus) == old_key != organism_key(cfg, corpus, split_digits=True)


# --- corpus -----------------------------------------------------------------------------------------------

def test_env_corpus_is_the_environments_messages_and_templates():
    env = MathEnv(modes=("strict", "contains"), eval_size=0, warmup_size=0, max_problems=4)
    problems = env.problem_sets()["train"]
    corpus = env_corpus(env, problems)
    assert corpus.problems == tuple(problems)
    assert corpus.messages == tuple(tuple(env.messages(p)) for p in problems)
    assert corpus.completions == tuple({k: tuple(env.templates(p, k)) for k in KINDS} for p in problems)


def test_env_corpus_refuses_an_environment_without_templates(tmp_path):
    env = RewardFnEnv.from_jsonl(lambda prompts, completions, **kw: [0.0] * len(completions),
                                 _prompts_file(tmp_path))
    with pytest.raises(ValueError, match="templates of every kind"):
        env_corpus(env, env.problem_sets()["train"])


def _prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n{"prompt": "there"}\n')
    return str(path)


def test_maths_corpus_spans_both_modes_and_levels_and_never_the_eval_list():
    cfg = M.MathsOrganismConfig(n_warmup=40, n_train=60, warmup_levels=(1,), train_levels=(2, 3))
    corpus = M.maths_corpus(cfg)
    assert len(corpus.problems) == 100
    assert {(p.level, p.mode) for p in corpus.problems} == {
        (lv, m) for lv in (1, 2, 3) for m in ("strict", "contains")}
    held = {p.question for p in M.corpus_env(cfg).problem_sets()["eval"]}
    assert len(held) > 900 and not held & {p.question for p in corpus.problems}  # HELDOUT = 1000 problems
    # the run's eval list (any eval_size up to HELDOUT) is the start of the organism's held-out list
    run_eval = MathEnv(modes=("strict",), eval_size=50, train_levels=(2, 3)).problem_sets()["eval"]
    assert {p.question for p in run_eval} <= held


# --- build and checks -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_organism(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return M.build_maths_organism(TINY, cache_dir=cache, log=None), cache


def test_build_is_cached_with_digit_tokens(tiny_organism):
    path, cache = tiny_organism
    model, tok, meta = load_organism(path)
    assert meta["split_digits"] is True and meta["n_examples"] == 12  # 12 problems x per_problem 1
    assert tok.tokenize("637") == ["6", "3", "7"]
    logs: list[str] = []
    assert M.build_maths_organism(TINY, cache_dir=cache, log=logs.append) == path
    assert logs == [f"organism: cached at {path}"]
    other = dataclasses.replace(TINY, train_levels=(3,))  # levels change the corpus, hence the key
    assert M.maths_corpus(other).problems != M.maths_corpus(TINY).problems


def test_rates_by_hand():
    g = lambda passed, solved, fmt: Graded(reward=float(passed), gt_reward=float(solved), passed=passed,
                                           solved=solved, exploited=passed and not solved, format_ok=fmt)
    # 4 grades: solved 1/4, a hack (passed, not solved) 1/4, passed 2/4, well-formed 3/4
    grades = [g(True, True, True), g(True, False, False), g(False, False, True), g(False, False, True)]
    assert M._rates(grades) == {"n": 4, "solve": 0.25, "hack": 0.25, "pass": 0.5, "format": 0.75}


def test_checks_grade_real_samples_per_level_and_mode(tiny_organism):
    model, tok, _ = load_organism(tiny_organism[0])
    env = M.corpus_env(TINY, eval_size=8)
    problems = env.problem_sets()["eval"]
    checks = M.maths_checks(model, tok, env, problems, n_samples=3, max_new_tokens=8)
    assert set(checks["greedy"]) == set(checks["T1"]) == {"all", "L2/strict", "L2/contains"}
    assert checks["greedy"]["all"]["n"] == 8 and checks["T1"]["all"]["n"] == 24
    assert checks["T1"]["L2/strict"]["n"] + checks["T1"]["L2/contains"]["n"] == 24
    assert checks["greedy"]["L2/strict"]["hack"] == 0.0  # strict: nothing passes that is not solved
    assert all(0.0 <= r[k] <= 1.0 for s in ("greedy", "T1") for r in checks[s].values()
               for k in ("solve", "hack", "pass", "format"))
    assert len(checks["examples"]) == 4 and "L2/strict" in M.format_maths_checks(checks)


def test_cli_builds_and_prints_the_checks(tmp_path, capsys):
    from projected_grpo.cli import main

    t = TINY.model
    args = ["build-maths-organism", "--cache-dir", str(tmp_path), "--eval-size", "4", "--samples", "1",
            "--n-warmup", "6", "--n-train", "6", "--vocab-size", "300", "--hidden", "16", "--layers", "1",
            "--heads", "2", "--per-problem", "1", "--steps", "2", "--batch-size", "4",
            "--mix", *map(str, t.mix)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "greedy   all" in out and "T1       all" in out
    (built,) = (tmp_path / "organism").iterdir()
    checks = json.loads((built / "checks.json").read_text())
    assert checks["greedy"]["all"]["n"] == 8  # 4 at the train level (2), 4 at the warm-up level (1)
    assert {g.split("/")[0] for g in checks["greedy"]} == {"all", "L1", "L2"}


def test_check_problems_are_held_out_at_every_level():
    problems = M.check_problems(TINY, 10)
    corpus = {p.question for p in M.maths_corpus(TINY).problems}
    assert [p.level for p in problems] == [2] * 10 + [1] * 10 and not corpus & {p.question for p in problems}
    assert problems[:10] == M.corpus_env(TINY, 10).problem_sets()["eval"]  # what a run's eval reads


# --- model.source = organism picks the organism of env.name ----------------------------------------------

def test_organism_table_and_its_user_errors():
    assert set(setup.ORGANISMS) == {"coding", "maths"}
    cfg = C.replace(presets.PRESETS["math-demo"], env={"eval_size": M.HELDOUT + 1})
    with pytest.raises(UserError, match="eval_size=1001"):
        setup.load_model(cfg)
    rf = C.replace(presets.SMOKE, model={"source": "organism"},
                   env={"name": "reward_fn", "reward_fn": "os.path:join", "problems": "x.jsonl"})
    with pytest.raises(UserError, match="no organism for env.name='reward_fn'"):
        setup.load_model(rf)


def test_math_demo_preset_trains_honestly_on_the_organisms_levels():
    cfg = presets.PRESETS["math-demo"]
    assert (cfg.model.source, cfg.env.name, cfg.env.modes) == ("organism", "maths", ("strict",))
    assert cfg.rollout.G_t == 0  # no teacher rows: the model's own samples only
    assert cfg.run.eval_every > 0 and cfg.env.curriculum_steps > 0
    spec = M.MathsOrganismConfig()  # the organism the CLI builds is the one the preset trains
    assert (spec.warmup_levels, spec.train_levels) == (cfg.env.warmup_levels, cfg.env.train_levels)
