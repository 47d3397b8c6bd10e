"""envs/base.py: Graded's one shape, the Environment protocol, and a TRL-style reward callable as an
environment (trained on end to end, as users bring their own reward).

Run: .venv/bin/pytest -q tests/test_envs_base.py
"""

from __future__ import annotations

import json

import pytest

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.cli import main
from projected_grpo.envs.base import Environment, Graded, PromptRow, RewardFnEnv, load_reward_fn
from projected_grpo.envs.coding.env import CodeEnv
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
from projected_grpo.envs.maths.env import MathEnv
from projected_grpo.errors import UserError


def distinct_chars(prompts, completions, bonus=None, **kw):
    """A TRL-style reward: the share of distinct characters, plus a per-row column `bonus` when given."""
    bonus = bonus or [None] * len(completions)
    return [len(set(c)) / max(1, len(c)) + (b or 0.0) for c, b in zip(completions, bonus)]


def test_graded_round_trip_and_refusals():
    g = Graded(reward=1.25, gt_reward=0.25, passed=True, solved=False, exploited=True, format_ok=True,
               extras={"det_E": True})
    assert Graded.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    bad = g.to_dict() | {"exploited": False}  # exploited must be passed and not solved
    with pytest.raises(UserError, match="exploited must be passed and not solved"):
        Graded.from_dict(bad, where="p.jsonl:3")
    with pytest.raises(UserError, match="p.jsonl:3: a grade needs exactly the fields"):
        Graded.from_dict({k: v for k, v in g.to_dict().items() if k != "gt_reward"}, where="p.jsonl:3")


def test_every_environment_meets_the_protocol():
    assert isinstance(CodeEnv(BUILTIN_PROBLEMS), Environment)
    assert isinstance(MathEnv(eval_size=2, warmup_size=2, max_problems=2), Environment)
    assert isinstance(RewardFnEnv(distinct_chars, [PromptRow("a", "hi", {})]), Environment)


def test_reward_fn_gets_prompts_completions_and_columns():
    rows = [PromptRow("a", "hi", {"bonus": 1.0}), PromptRow("b", [{"role": "user", "content": "yo"}], {})]
    env = RewardFnEnv(distinct_chars, rows, system_prompt="be brief")
    # "aab": 2 distinct of 3 = 0.6667, + bonus 1.0; "ab": 2 of 2 = 1.0, no bonus (None)
    got = env.grade(["aab", "ab"], rows)
    assert [round(g.reward, 4) for g in got] == [1.6667, 1.0]
    assert all(g.passed and not g.solved and not g.exploited and g.gt_reward == g.reward for g in got)
    assert env.messages(rows[0]) == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hi"}]
    assert env.messages(rows[1]) == rows[1].prompt and env.templates(rows[0], "hack") == []


def test_reward_fn_spec_and_file_errors(tmp_path):
    with pytest.raises(UserError, match="expected 'module.path:function'"):
        load_reward_fn("no_colon")
    with pytest.raises(UserError, match="cannot import it"):
        load_reward_fn("no_such_module_xyz:fn")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(UserError, match=r"p.jsonl:2: a prompt row must be a JSON object with a 'prompt'"):
        RewardFnEnv.from_jsonl(distinct_chars, str(tmp_path / "p.jsonl"))


def test_training_on_a_plain_reward_callable(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_reward.py").write_text("def reward(prompts, completions, **kw):\n"
                                           "    return [len(set(c)) / max(1, len(c)) for c in completions]\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "say hi"}\n{"prompt": "count to three"}\n')
    argv = ["train", "--env.name", "reward_fn", "--env.reward-fn", "my_reward:reward", "--env.problems",
            str(tmp_path / "prompts.jsonl"), "--rollout.mix", "0", "--run.steps", "2"]
    assert main([*argv, "--run-dir", str(tmp_path / "none")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "none" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and 0 < rows[0]["reward/mean"] <= 1 and rows[0]["hack/student"] == 0.0
    # a projection arm needs V_hack, and a plain reward has no hack/clean templates to pair: one line
    assert main([*argv, "--arm", "erase", "--run-dir", str(tmp_path / "erase")]) == 2
    assert "needs V_hack" in capsys.readouterr().err
    cfg = C.replace(presets.SMOKE, env={"name": "reward_fn", "reward_fn": "my_reward:reward"})
    assert cfg.env.reward_fn == "my_reward:reward"
