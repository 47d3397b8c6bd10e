"""A run's monitor and intervention (run/intervene.py): the stage tables, hand-made verdicts, and short smoke
runs of the loop with an intervention (inoculation's two prompts, the screen's zero-weight rows, resume).

Run: pytest tests/test_intervene.py   (the per-intervention runs and the resume check are marked slow)
"""

from __future__ import annotations

import json
import pathlib
import shutil
import typing

import pytest
import torch

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.envs.base import Graded
from projected_grpo.errors import UserError
from projected_grpo.run import intervene, metrics
from projected_grpo.run import train as T
from projected_grpo.sampling.sample import Sample


def cfg_with(**monitor) -> C.Config:
    return C.replace(presets.SMOKE, monitor=monitor)


def test_every_intervention_has_both_stages():
    names = typing.get_args(typing.get_type_hints(C.MonitorCfg)["intervention"])
    assert set(intervene.REWARD_STAGES) == set(names) == set(intervene.ADVANTAGE_STAGES)


def test_stages_on_a_hand_made_verdict():
    r = torch.tensor([[1.25, 0.25, 1.25, 0.0]])
    v = intervene.Verdict(torch.tensor([[1.0, 0.0, 0.5, 0.0]]), torch.tensor([[True, False, False, False]]))
    # penalty: the flagged row's 1.25 - 2.0 = -0.75 (monitor.penalty's default)
    out, stats = intervene.rewards(cfg_with(kind="ground_truth", intervention="penalty"), r, v)
    assert out.tolist() == [[-0.75, 0.25, 1.25, 0.0]] and stats == {"monitor/penalised_frac": 0.25}
    # screen, baseline dropped: dr_grpo over (0.25, 1.25, 0): (0, -0.25, 0.75, -0.5); the flagged row is out
    adv, keep, stats = intervene.advantages(cfg_with(kind="probe", intervention="screen"), r, v)
    assert adv.tolist() == [[0.0, -0.25, 0.75, -0.5]] and keep.tolist() == [[False, True, True, True]]
    assert stats["reward/mean"] == pytest.approx(0.6875)
    assert stats["adv/mean"] == pytest.approx(0.0)
    # advantage: dr_grpo (0.5625, -0.4375, 0.5625, -0.6875) minus the centred score (0.625, -0.375, 0.125,
    # -0.375) = (-0.0625, -0.0625, 0.4375, -0.3125)
    adv, keep, stats = intervene.advantages(cfg_with(kind="probe", intervention="advantage"), r, v)
    torch.testing.assert_close(adv, torch.tensor([[-0.0625, -0.0625, 0.4375, -0.3125]]))
    assert keep.all() and stats["monitor/adv_shift"] == pytest.approx((0.625 + 0.375 + 0.125 + 0.375) / 4)
    # an all-equal reward group whose scores differ has a signal under `advantage` (the loop trains it)
    same = torch.full((1, 4), 1.25)
    adv, _, _ = intervene.advantages(cfg_with(kind="probe", intervention="advantage"), same, v)
    assert (adv != 0).any()
    adv, _, _ = intervene.advantages(cfg_with(), same, None)
    assert (adv == 0).all()


def _sample(exploited: bool, student: bool = True) -> Sample:
    g = Graded(1.25 if exploited else 0.0, 0.0, exploited, False, exploited, True)
    return Sample("p", "run_tests", torch.tensor([1]), torch.tensor([2]), "x", None, False, student, g)


def test_rates_are_over_the_student_rows():
    groups = [[_sample(True), _sample(False), _sample(True, student=False)]]
    v = intervene.Verdict(torch.zeros(1, 3), torch.tensor([[True, True, True]]))
    # students: flagged both; one hack of the two -> precision 0.5, recall 1 (the teacher hack is not counted)
    assert intervene.rates(groups, v) == {"monitor/flagged_frac": 1.0, "monitor/precision": 0.5,
                                          "monitor/recall": 1.0}


def test_config_refuses_what_cannot_run():
    with pytest.raises(UserError, match="set monitor.kind"):
        C.MonitorCfg(intervention="screen")
    with pytest.raises(UserError, match="changes the prompt"):
        C.MonitorCfg(kind="probe", intervention="inoculation")
    with pytest.raises(UserError, match="PPO"):
        C.replace(presets.SMOKE, loss={"algo": "ppo"}, monitor={"kind": "probe", "intervention": "screen"})
    with pytest.raises(UserError, match="accuracy"):
        C.MonitorCfg(accuracy=1.5)


def small(root: pathlib.Path, name: str, **sections) -> C.Config:
    cfg = C.replace(presets.SMOKE, env={"max_problems": 6}, rollout={"max_new_tokens": 8},
                    model={"cache_dir": str(root / "cache")},
                    run={"steps": 2, "checkpoint_every": 1, "dir": str(root / name)})
    return C.replace(cfg, **sections)


def test_inoculation_trains_under_its_prompt_and_deploys_under_the_normal_one(tmp_path, monkeypatch):
    from projected_grpo.run import batches as B
    from projected_grpo.run import session

    seen = []
    real = B.sample_and_grade

    def spy(model, tok, env, problems, prompt_ids, *a, **kw):
        seen.append({p.id: prompt_ids[p.id] for p in problems})
        return real(model, tok, env, problems, prompt_ids, *a, **kw)

    monkeypatch.setattr(B, "sample_and_grade", spy)
    got = {}
    real_open = session.open_data

    def open_data(*a, **kw):
        got["data"] = real_open(*a, **kw)
        return got["data"]

    monkeypatch.setattr(T.session, "open_data", open_data)
    T.train(small(tmp_path, "inoc", monitor={"intervention": "inoculation"}, run={"steps": 1}))
    data = got["data"]
    pid = next(iter(seen[0]))
    assert not torch.equal(data.train_prompt_ids[pid], data.prompt_ids[pid])  # the inoculation prompt ...
    assert torch.equal(seen[0][pid], data.train_prompt_ids[pid])  # ... the students sample under it ...
    assert torch.equal(seen[1][pid], data.prompt_ids[pid])  # ... the deployed model under the normal one


def test_screen_gives_flagged_rows_no_gradient(tmp_path, monkeypatch):
    # a degraded monitor at accuracy 0.5 flags rows at random; with a KL term (beta > 0) a screened row's only
    # gradient would be its KL, so the loop must weight its tokens 0: spy on what the aggregation receives
    steps, calls = [], []
    real_adv, real_agg = intervene.advantages, T.AGGREGATIONS["dr_grpo"]

    def adv_spy(cfg, r, v):
        out = real_adv(cfg, r, v)
        steps.append(out)
        return out

    def agg_spy(tok, mask, denoms):
        calls.append((len(steps) - 1, tok.detach().clone()))
        return real_agg(tok, mask, denoms)

    monkeypatch.setattr(T.intervene, "advantages", adv_spy)
    monkeypatch.setitem(T.AGGREGATIONS, "dr_grpo", agg_spy)
    cfg = small(tmp_path, "scr", loss={"beta": 0.1}, rollout={"micro_prompts": 0},
                monitor={"kind": "degraded", "accuracy": 0.5, "intervention": "screen"}, run={"steps": 3})
    T.train(cfg)
    screened, kept_nonzero = 0, 0
    for step, tok in calls:  # each micro-batch: the policy term, then the KL term
        adv, in_loss, _ = steps[step]
        groups = [b for b in range(adv.shape[0]) if (adv[b] != 0).any()]  # the groups the loss saw
        rows = in_loss[groups].reshape(-1)
        assert (tok[~rows] == 0).all()
        screened += int((~rows).sum())
        kept_nonzero += int((tok[rows] != 0).any(1).sum())
    assert screened > 0 and kept_nonzero > 0  # the check had screened rows, and kept rows with a loss


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["penalty:ground_truth", "screen:direction", "advantage:probe",
                                 "penalty:detector", "screen:degraded70", "erase_bounded"])
def test_each_bench_arm_trains_on_smoke(tmp_path, arm):
    from projected_grpo.study import arms

    T.train(small(tmp_path, "r", **arms.arm_sections(arm)))
    rows = metrics.read_rows(tmp_path / "r" / "metrics.jsonl")
    assert len(rows) == 2 and all("knob/v_coef" in r for r in rows)
    if arm != "erase_bounded":
        assert json.loads((tmp_path / "r" / intervene.MONITOR_FILE).read_text())["intervention"] \
            == arm.split(":")[0]
        assert all("monitor/flagged_frac" in r for r in rows)
    else:
        assert all(r["knob/v_coef"] <= 1e-5 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2])
def test_a_resumed_direction_screen_run_equals_an_uninterrupted_one(tmp_path, every):
    # the monitor is rebuilt on resume (direction: its held-out pairs; a probe would be refitted at the base
    # model), so the run continues as if never stopped: step 2 again from the step-2 checkpoint, which is a
    # step that re-scores the held-out pairs also when that happens every 2nd step only
    sections = {"monitor": {"kind": "direction", "intervention": "screen", "direction_every": every}}
    T.train(small(tmp_path, "whole", run={"steps": 3, "checkpoint_every": 2}, **sections))
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "ckpt-000003")
    T.train(small(tmp_path, "cut", run={"steps": 3, "checkpoint_every": 2, "resume": True}, **sections))
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    assert strip(metrics.read_rows(tmp_path / "cut" / "metrics.jsonl")) == \
        strip(metrics.read_rows(tmp_path / "whole" / "metrics.jsonl"))
    rescored = ["monitor/heldout_bacc" in r for r in metrics.read_rows(tmp_path / "whole" / "metrics.jsonl")]
    assert rescored == ([True, True, True] if every == 1 else [True, False, True])
