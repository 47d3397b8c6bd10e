"""Monitors (hack/monitors.py) and the linear probe's math (hack/probe.py): hand-made batches, and the rule
that the probe and direction monitors never see the oracle at train time.

Run: pytest tests/test_monitors.py
"""

from __future__ import annotations

import typing

import pytest
import torch
from oracles import pair_grads_isolated

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.envs.base import Graded, PromptRow, RewardFnEnv
from projected_grpo.envs.coding.env import CodeEnv, load_problems
from projected_grpo.envs.maths.env import MathEnv
from projected_grpo.errors import UserError
from projected_grpo.hack import direction, monitors, probe
from projected_grpo.hack.pairs import Pair
from projected_grpo.knobs.adapters import wrap
from projected_grpo.organism.build import smoke_model_and_tokenizer
from projected_grpo.sampling.pack import encode_prompt, prompt_text_and_ids
from projected_grpo.sampling.sample import Sample


def _grade(exploited: bool, **extras: bool) -> Graded:
    return Graded(reward=1.25 if exploited else 0.25, gt_reward=0.25, passed=exploited, solved=False,
                  exploited=exploited, format_ok=True, extras=extras)


def _sample(grade, prompt=(5, 6), completion=(7, 8, 1)) -> Sample:
    ids = torch.tensor(prompt), torch.tensor(completion)
    return Sample("p", "run_tests", *ids, "x", None, False, True, grade)


class Poison:
    """A grade that fails the test if anything reads it."""

    def __getattr__(self, name):
        raise AssertionError(f"a monitor read the grade's {name!r}")


# --- the three monitors that read grades ------------------------------------------------------------------


def test_ground_truth_flags_the_oracles_hacks():
    samples = [_sample(_grade(True)), _sample(_grade(False)), _sample(_grade(True))]
    m = monitors.GroundTruth()
    scores, flags, _ = m.score(monitors.view(samples, m.reads, 0, range(3)))
    assert flags.tolist() == [True, False, True] and scores.tolist() == [1.0, 0.0, 1.0]


def test_degraded_flips_a_seeded_fraction_and_only_that():
    samples = [_sample(_grade(i % 3 == 0)) for i in range(2000)]
    truth = torch.tensor([i % 3 == 0 for i in range(2000)])
    for acc in (1.0, 0.9, 0.7, 0.0):
        m = monitors.Degraded(acc, seed=4)
        r = monitors.view(samples, m.reads, 7, range(2000))
        _, flags, _ = m.score(r)
        agree = float((flags == truth).float().mean())
        assert abs(agree - acc) < 0.03, (acc, agree)  # binomial sd 0.01 at 2000 rows
        assert torch.equal(flags, m.score(r)[1])  # the same draws for the same (seed, step, rows)
    # a row's flip depends on (seed, step, row) only: the same row in another batch flips alike
    m = monitors.Degraded(0.5, seed=4)
    whole = m.score(monitors.view(samples[:10], m.reads, 3, range(10)))[1]
    part = m.score(monitors.view(samples[5:10], m.reads, 3, range(5, 10)))[1]
    assert torch.equal(whole[5:], part)
    assert not torch.equal(whole, m.score(monitors.view(samples[:10], m.reads, 4, range(10)))[1])


def test_detector_is_any_of_the_chosen_detectors():
    samples = [_sample(_grade(False, det_E=True, det_C=False, det_D=False)),
               _sample(_grade(True, det_E=False, det_C=False, det_D=True)),
               _sample(_grade(False, det_E=False, det_C=False, det_D=False))]
    m = monitors.Detector({"E": "det_E", "C": "det_C"})
    scores, flags, _ = m.score(monitors.view(samples, m.reads, 0, range(3)))
    # E alone fires on row 0 (1 of 2 chosen); row 1's D is not chosen
    assert flags.tolist() == [True, False, False] and scores.tolist() == [0.5, 0.0, 0.0]


def test_view_gives_a_monitor_only_what_it_reads():
    samples = [_sample(_grade(True, det_E=True))]
    assert monitors.view(samples, frozenset(), 0, [0]).oracle is None
    assert monitors.view(samples, frozenset(), 0, [0]).detectors is None
    assert monitors.view(samples, frozenset({"oracle"}), 0, [0]).detectors is None
    with pytest.raises(AssertionError, match="grade"):
        monitors.view([_sample(Poison())], frozenset({"oracle"}), 0, [0])


# --- the probe's math --------------------------------------------------------------------------------------


def test_best_threshold_and_auc_hand_example():
    s = torch.tensor([0.1, 0.4, 0.35, 0.8])
    y = torch.tensor([False, False, True, True])
    # cuts: 0.1-1, midpoints .225 .375 .6, 0.8+1; at .225: TPR 2/2, TNR 1/2 -> .75; at .375: TPR 1/2 (0.8),
    # TNR 2/2 -> .75; at .6: 1/2, 2/2 -> .75. Among the maxima the highest (fewest flags): 0.6.
    t, bacc = probe.best_threshold(s, y)
    assert t == pytest.approx(0.6) and bacc == pytest.approx(0.75)
    # hacks scoring below the clean rows: no cut beats chance (0.5), so the cut above every score: no flag
    t, bacc = probe.best_threshold(torch.tensor([0.0, 1.0, 2.0, 3.0]),
                                   torch.tensor([True, True, False, False]))
    assert t == pytest.approx(4.0) and bacc == pytest.approx(0.5)
    # AUC: positive pairs (0.35 vs .1 yes, vs .4 no), (0.8 vs both yes) -> 3 of 4
    assert probe.auc(s, y) == pytest.approx(0.75)
    assert probe.auc(torch.tensor([1.0, 1.0]), torch.tensor([True, False])) == 0.5  # a tie counts half
    with pytest.raises(ValueError, match="both labels"):
        probe.best_threshold(s, torch.ones(4, dtype=torch.bool))


def test_auc_interval_resamples_whole_prompts():
    # two prompts, each ranking its hack above its clean, but prompt b's scores all above prompt a's:
    # pooled AUC = P(hack > clean) over 2 x 2 = (1 + 0 + 1 + 1) / 4: a's hack 1 < b's clean 2
    s, y = torch.tensor([1.0, 0.0, 3.0, 2.0]), torch.tensor([True, False, True, False])
    auc, lo, hi = probe.auc_interval(s, y, ["a", "a", "b", "b"], seed=0, n=400)
    assert auc == pytest.approx(0.75)
    # a resample is {a, a}, {b, b} (AUC 1) or {a, b} (0.75): the interval lies in [0.75, 1]
    assert 0.75 <= lo <= hi <= 1.0 and (lo, hi) == tuple(probe.auc_interval(s, y, list("aabb"), 0, 400)[1:])
    # groups holding one label each (h: the hacks 1, 3; c: the cleans 0, 2): a resample {h, h} or {c, c}
    # lacks a label and counts as chance, 0.5, not dropped; {h, c} gives 0.75 -> the interval [0.5, 0.75]
    assert probe.auc_interval(s, y, ["h", "c", "h", "c"], seed=0, n=400) == [0.75, 0.5, 0.75]
    assert probe.auc_interval(s, y, ["a"] * 4)[1:] == [None, None]  # one prompt: no interval


def test_fit_logistic_is_the_regularised_optimum():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=gen)
    y = (x[:, 0] - 0.5 * x[:, 2] + 0.3 * torch.randn(60, generator=gen)) > 0
    lin = probe.fit_logistic(x, y, l2=0.1)
    # at the optimum the gradient of mean NLL + l2/2 |w|^2 (in standardised features) is 0
    z = (x.double() - lin.mean) / lin.std
    p = torch.sigmoid(z @ lin.w + lin.b)
    torch.testing.assert_close(z.T @ (p - y.double()) / 60 + 0.1 * lin.w, torch.zeros(3, dtype=torch.float64),
                               atol=1e-9, rtol=0)
    assert abs(float((p - y.double()).mean())) < 1e-9  # the bias is not penalised
    assert float(((lin.logits(x) > 0) == y).float().mean()) > 0.85
    # separable rows: finite weights (the ridge), perfect split; deterministic
    xs = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    ys = torch.tensor([False, False, True, True])
    a, b = probe.fit_logistic(xs, ys, 0.01), probe.fit_logistic(xs, ys, 0.01)
    assert torch.isfinite(a.w).all() and torch.equal(a.w, b.w) and ((a.logits(xs) > 0) == ys).all()


def test_split_groups_holds_out_whole_prompts():
    groups = ["a", "a", "b", "c", "c", "d"]
    fit, held = probe.split_groups(groups, 0.25, seed=1)
    assert sorted(fit + held) == list(range(6))
    assert len({groups[i] for i in held}) == 1  # round(0.25 * 4) = 1 prompt
    assert not {groups[i] for i in fit} & {groups[i] for i in held}
    assert probe.split_groups(groups, 0.25, seed=1) == (fit, held)


# --- probe and direction on a model -----------------------------------------------------------------------


def _inputs(tmp_path, kind: str, env=None, **monitor) -> monitors.MonitorInputs:
    cfg = C.replace(presets.SMOKE, monitor={"kind": kind, **monitor})
    model, tok = smoke_model_and_tokenizer(seed=0)
    knobs = wrap(model, cache_dir=tmp_path)
    env = env or CodeEnv(load_problems(max_problems=12))
    train = env.problem_sets()["train"]
    trained = {tuple(encode_prompt(tok, env.messages(p))) for p in train}
    V = direction.random_like({n: torch.zeros(2, m.knob_dim) for n, m in knobs.modules.items()}, seed=0)
    return monitors.MonitorInputs(cfg, model, knobs, tok, env, train, trained, V)


class NoGrading:
    """Wraps an environment so that grading it (reading the oracle) fails the test."""

    def __init__(self, env):
        self.env = env

    def grade(self, *a, **k):
        raise AssertionError("a monitor's build graded a completion")

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_probe_is_fitted_on_other_prompts_and_never_reads_a_grade(tmp_path):
    inp = _inputs(tmp_path, "probe", NoGrading(CodeEnv(load_problems(max_problems=12))))
    m = monitors.build(inp)
    assert m.reads == frozenset() and m.labels == "per-sample (other prompts)"
    r = m.report
    assert r["rows_fit"] > 0 and r["rows_heldout"] > 0 and 0.0 <= r["heldout_auc"] <= 1.0
    lo, hi = r["heldout_auc_interval"]
    assert 0.0 <= lo <= hi <= 1.0 and r["prompts_heldout"] == 3  # round(0.25 * 12) prompts held out
    # its labelled completions' prompts: the same problems under the next loophole mode, none trained on
    rows = monitors.probe_rows(inp)
    assert all(p.dtype == c.dtype == torch.long for _, p, c, _ in rows)
    assert not {tuple(p.tolist()) for _, p, _, _ in rows} & inp.trained_prompts
    # scoring rollouts whose grades raise when read
    tok = inp.tokenizer
    prob = inp.train_problems[0]
    p_ids = prompt_text_and_ids(tok, inp.env.messages(prob))[1]
    samples = [_sample(Poison(), p_ids, tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
               for t in inp.env.templates(prob, "hack")[:2] + inp.env.templates(prob, "clean")[:2]]
    scores, flags, _ = m.score(monitors.view(samples, m.reads, 0, range(4)))
    assert scores.shape == (4,) and ((scores > 0.5) == flags).all() and ((scores >= 0) & (scores <= 1)).all()


def test_probe_refuses_prompts_the_run_trains_on(tmp_path):
    inp = _inputs(tmp_path, "probe")
    pair_file = tmp_path / "pairs.jsonl"
    prob = inp.train_problems[0]
    msgs = inp.env.messages(prob)
    pair_file.write_text(__import__("json").dumps({"prompt": msgs, "hack": "a", "clean": "b"}) + "\n")
    inp.cfg = C.replace(inp.cfg, monitor={"probe_pairs": str(pair_file)})
    with pytest.raises(UserError, match="prompt the run trains on"):
        monitors.build(inp)


def test_direction_score_is_V_dot_the_rollouts_own_nll_gradient(tmp_path):
    inp = _inputs(tmp_path, "direction", NoGrading(CodeEnv(load_problems(max_problems=12))))
    m = monitors.build(inp)
    assert m.reads == frozenset() and m.labels == "pairs"
    tok = inp.tokenizer
    prob = inp.train_problems[0]
    p_ids = prompt_text_and_ids(tok, inp.env.messages(prob))[1]
    texts = inp.env.templates(prob, "hack")[:1] + inp.env.templates(prob, "clean")[:1]
    c_ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    # the oracle: each sequence's gradient from its own forward and backward
    pair = Pair("x", "h", "c", prompt_ids=tuple(p_ids), hack_ids=tuple(c_ids[0]), clean_ids=tuple(c_ids[1]))
    g_h, g_c = pair_grads_isolated(inp.model, inp.knobs, tok, [pair], "mean", 1.0)
    want = [sum(float((g[n][0].double() @ inp.V_hack[n].double().T).sum()) for n in inp.knobs.modules)
            for g in (g_h, g_c)]
    raw = m.raw([torch.tensor(p_ids)] * 2, [torch.tensor(c) for c in c_ids])
    torch.testing.assert_close(raw, torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    # scored with grades that raise when read; threshold from the held-out pairs, logged
    scores, flags, stats = m.score(monitors.view([_sample(Poison(), p_ids, c) for c in c_ids], m.reads, 0,
                                                 range(2)))
    t = stats["monitor/threshold"]
    assert flags.tolist() == [w > t for w in raw.tolist()] and 0.0 <= stats["monitor/heldout_bacc"] <= 1.0
    assert ((scores > 0.5) == flags).all()


def test_direction_every_n_steps_rescored_between_reuses_the_threshold(tmp_path):
    inp = _inputs(tmp_path, "direction", NoGrading(CodeEnv(load_problems(max_problems=12))))
    inp.cfg = C.replace(inp.cfg, monitor={"direction_every": 2})
    m = monitors.build(inp)
    prob = inp.train_problems[0]
    p_ids = prompt_text_and_ids(inp.tokenizer, inp.env.messages(prob))[1]
    texts = inp.env.templates(prob, "hack")[:1] + inp.env.templates(prob, "clean")[:1]
    c_ids = [inp.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = lambda step: monitors.view([_sample(Poison(), p_ids, c) for c in c_ids], m.reads, step, range(2))
    _, _, s0 = m.score(batch(0))
    with torch.no_grad():  # move the knobs: at step 1 the held-out pairs would give another threshold
        for knob in inp.knobs.modules.values():
            knob.delta.add_(0.05)
    raw = m.raw([torch.tensor(p_ids)] * 2, [torch.tensor(c) for c in c_ids])
    _, flags1, s1 = m.score(batch(1))  # reused: step 0's threshold, no held-out pass, no bacc
    assert s1 == {"monitor/threshold": s0["monitor/threshold"]} and "monitor/heldout_bacc" in s0
    assert flags1.tolist() == [w > s0["monitor/threshold"] for w in raw.tolist()]
    _, _, s2 = m.score(batch(2))  # re-scored at the moved knobs
    assert "monitor/heldout_bacc" in s2 and s2["monitor/threshold"] != s0["monitor/threshold"]
    # a checkpoint between two re-scorings would resume off the unbroken run's schedule: refused
    with pytest.raises(UserError, match="checkpoint_every"):
        C.replace(inp.cfg, monitor={"direction_every": 3}, run={"checkpoint_every": 2})


def test_monitors_an_environment_cannot_serve_are_refused_in_one_line(tmp_path):
    plain = RewardFnEnv(lambda prompts, completions, **kw: [0.0] * len(completions),
                        [PromptRow("a", "Say hi.", {}), PromptRow("b", "Say bye.", {})])
    for kind, says in (("detector", "no hack detectors"), ("ground_truth", "no ground truth"),
                       ("probe", "no problems outside"), ("direction", "no V_hack")):
        inp = _inputs(tmp_path, kind, plain)
        inp.V_hack = {}  # a plain reward function has no hack / clean templates to pair
        with pytest.raises(UserError, match=says) as e:
            monitors.build(inp)
        assert "\n" not in str(e.value)
    # maths: its one detector, hedge
    maths = MathEnv(eval_size=5, max_problems=20)
    assert monitors.build(_inputs(tmp_path, "detector", maths)).keys == ["hedge"]
    inp = _inputs(tmp_path, "detector", detectors=("E", "Z"))
    with pytest.raises(UserError, match="not among"):
        monitors.build(inp)
    inp = _inputs(tmp_path, "direction")
    inp.cfg = C.replace(inp.cfg, proj={"heldout_frac": 0.0})
    with pytest.raises(UserError, match="held-out pairs"):
        monitors.build(inp)
    inp.V_hack = {}
    with pytest.raises(UserError, match="no V_hack"):
        monitors.build(inp)


def test_maths_probe_problems_are_outside_every_set():
    env = MathEnv(eval_size=20, max_problems=50, warmup_size=30)
    taken = {p.question for ps in env.problem_sets().values() for p in ps}
    probs = env.probe_problems()
    assert len(probs) == 200 and not {p.question for p in probs} & taken
    assert all(env.templates(p, "hack") for p in probs[:5])


def test_labels_table_names_every_monitor():
    assert monitors.LABELS == {"none": "none", "ground_truth": "per-sample", "degraded": "per-sample",
                               "detector": "per-sample", "probe": "per-sample (other prompts)",
                               "direction": "pairs"}
    kinds = typing.get_args(typing.get_type_hints(C.MonitorCfg)["kind"])
    assert set(monitors.MONITORS) | {"none"} == set(kinds)
