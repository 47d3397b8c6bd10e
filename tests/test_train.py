"""The GRPO loop end to end on the smoke model: files, invariants, arms, teacher modes, failures, resume.

Three short in-process runs (one per arm, each with another teacher mode) are shared by most tests;
`projection.apply_arm` is wrapped by a spy that records the gradients the loop hands to it.
Run: .venv/bin/pytest -q tests/test_train.py   (the SIGKILL resume test is marked slow)
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.errors import UserError
from projected_grpo.knobs import projection
from projected_grpo.run import metrics
from projected_grpo.run import pool as PL
from projected_grpo.run import train as T
from projected_grpo.sampling import generate as sampling_generate
from projected_grpo.sampling import pack, prefix
from projected_grpo.sampling import sample as sampling_sample

TIME_KEYS = ("time/generate", "time/grade", "time/backward", "time/step")


def small(root: pathlib.Path, name: str, **sections) -> C.Config:
    """The smoke preset cut down further: 6 problems, 8 new tokens, 2 steps, checkpoint every step."""
    cfg = C.replace(presets.SMOKE, env={"max_problems": 6}, rollout={"max_new_tokens": 8},
                    model={"cache_dir": str(root / "cache")},
                    run={"steps": 2, "checkpoint_every": 1, "dir": str(root / name)})
    return C.replace(cfg, **sections)


class Spy:
    """Wraps projection.apply_arm: records the full knob grads and the per-source split it receives;
    and train's generate: records each call's seed, temperature and the quarantine knob's norm then."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        self.generations: list[dict] = []
        self.knobs = None
        real = projection.apply_arm
        real_generate = sampling_generate.generate  # what sample_and_grade, the one sampling path, calls

        def generate(model, prompts, G, **kw):
            hack = [m.delta_hack for m in self.knobs.modules.values()] if self.knobs else []
            self.generations.append({"seed": kw["seed"], "temperature": kw["temperature"],
                                     "hack_norm": float(sum(h.norm() for h in hack)) if hack else 0.0})
            return real_generate(model, prompts, G, **kw)

        monkeypatch.setattr(sampling_sample, "generate", generate)

        def spy(knobs, V_hack, arm, *args, split=None, **kw):
            self.knobs = knobs
            self.calls.append({"g": {n: g.clone() for n, g in knobs.grads("main").items()},
                               "g_s": {n: g.clone() for n, g in split.g_student.items()},
                               "g_t": {n: g.clone() for n, g in split.g_teacher.items()}})
            return real(knobs, V_hack, arm, *args, split=split, **kw)

        monkeypatch.setattr(projection, "apply_arm", spy)


def behaviour_pool(root: pathlib.Path, cfg: C.Config) -> pathlib.Path:
    """Template rows with behaviour log-probs from another (seed 1) smoke model: an honest 'teacher'."""
    from projected_grpo.organism.build import smoke_model_and_tokenizer
    from projected_grpo.run import setup
    from projected_grpo.sampling.pack import pack
    from projected_grpo.sampling.score import forward_logprobs

    teacher, tok = smoke_model_and_tokenizer(seed=1)
    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = env.problem_sets()["train"]
        rows = PL.template_rows(env, problems, tok, setup.prompt_table(env, tok, problems),
                                {"hack": 1, "clean": 1})
    with torch.no_grad():
        for r in rows:
            batch = pack([r["prompt_ids"]], [r["completion_ids"]], tok.pad_token_id)
            logp, _ = forward_logprobs(teacher, batch)
            r["logp_behaviour"] = logp[0].tolist()
    PL.write_pool(root / "behaviour_pool.jsonl", rows)
    return root / "behaviour_pool.jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """arm -> (cfg, metrics rows, spy, summary) for erase+imitation, none+exclude, route+importance."""
    root = tmp_path_factory.mktemp("train")
    out = {}
    for arm, teacher in (("erase", "imitation"), ("none", "exclude"), ("route", "importance")):
        cfg = small(root, arm, proj={"arm": arm}, loss={"teacher": teacher})
        if teacher == "importance":  # also: deploy-eval every step, V refresh at step 1, a KL term
            cfg = C.replace(cfg, pool={"path": str(behaviour_pool(root, cfg))}, loss={"is_trunc": 1.5,
                            "beta": 0.04}, run={"eval_every": 1}, proj={"refresh_every": 2})
        with pytest.MonkeyPatch.context() as mp:
            spy = Spy(mp)
            summary = T.train(cfg)
        out[arm] = (cfg, metrics.read_rows(pathlib.Path(cfg.run.dir) / "metrics.jsonl"), spy, summary)
    return out


def test_smoke_writes_run_dir_and_finite_metrics(runs):
    cfg, rows, _, summary = runs["erase"]
    d = pathlib.Path(cfg.run.dir)
    assert {"metrics.jsonl", "summary.json", "config.json", "ckpt-000001", "ckpt-000002", "pool.jsonl"} <= {
        p.name for p in d.iterdir()}
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temp files left behind
    # config.json holds the run's config with rollout.seed_scope "auto" resolved ("batch": one process)
    assert C.Config.from_json(str(d / "config.json")) == C.replace(cfg, rollout={"seed_scope": "batch"})
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert set(metrics.REQUIRED_METRICS) <= set(r) and metrics.undocumented(r) == []
        assert all(math.isfinite(v) for v in r.values() if not isinstance(v, str))
    assert json.loads((d / "summary.json").read_text())["arm"] == "erase" and "sample" in summary


def test_kl_is_zero_at_step_zero_and_absent_at_beta_zero(runs):
    # knobs start at zero, so the policy IS the reference (knobs zeroed): k3 = expm1(0) - 0 = 0 exactly
    assert runs["route"][1][0]["kl/mean"] == 0.0 and runs["route"][1][1]["kl/mean"] > 0.0
    # beta 0: the KL term has no weight, so no reference forward runs and no kl/* is logged
    for arm in ("erase", "none"):
        assert not any(k.startswith("kl/") for r in runs[arm][1] for k in r)


def test_no_reference_forward_at_beta_zero_and_the_same_knobs(runs, tmp_path, monkeypatch):
    calls = []
    real = T.scoring  # the loop's scoring forward, chosen at setup (sampling/prefix.py)
    monkeypatch.setattr(T, "scoring", lambda *a, **k: (s := real(*a, **k))._replace(
        logprobs=lambda *a, **k: calls.append(torch.is_grad_enabled()) or s.logprobs(*a, **k)))
    cfg = C.replace(runs["erase"][0], run={"steps": 1, "dir": str(tmp_path / "b0")})
    T.train(cfg)
    assert calls == [True]  # one micro-batch: the training forward only
    calls.clear()
    T.train(C.replace(cfg, loss={"beta": 1e-12}, run={"dir": str(tmp_path / "b1")}))
    assert calls == [False, True]  # the reference, then the training forward
    k0 = load_file(tmp_path / "b0/ckpt-000001/knobs.safetensors")
    k1 = load_file(tmp_path / "b1/ckpt-000001/knobs.safetensors")
    # at step 0 the policy is the reference, so KL's gradient is 0 too: the same update either way
    assert all(torch.equal(k0[k], k1[k]) for k in k0)


def test_knobs_move_and_base_weights_do_not(runs):
    from projected_grpo.organism.build import smoke_model_and_tokenizer

    knobs = runs["erase"][2].knobs
    assert all(float(v.abs().sum()) > 0 for v in knobs.values("main").values())
    fresh, _ = smoke_model_and_tokenizer(seed=0)
    ref = dict(fresh.named_parameters())
    for name, p in knobs.model.named_parameters():
        if name.endswith((".delta", ".delta_hack")):
            continue
        assert torch.equal(p, ref[name.replace(".base.", ".")]), name


def test_student_plus_teacher_gradient_is_the_full_gradient(runs):
    for arm in ("erase", "route"):
        for call in runs[arm][2].calls:
            for n, g in call["g"].items():
                torch.testing.assert_close(call["g_s"][n] + call["g_t"][n], g, rtol=1e-5, atol=1e-7)


def test_quarantine_moves_only_under_route(runs):
    for arm in ("none", "erase"):
        assert all(r["knob/hack_norm"] == 0.0 for r in runs[arm][1])
        assert all(float(v.abs().max()) == 0.0 for v in runs[arm][2].knobs.values("hack").values())
    assert runs["route"][1][-1]["knob/hack_norm"] > 0.0
    assert all(r["knob/hack_step"] == 0.0 and r["knob/step"] > 0.0 for arm in ("none", "erase")
               for r in runs[arm][1])
    r0 = runs["route"][1][0]  # step 0 from zero: the quarantine's norm is its first step
    assert math.isclose(r0["knob/hack_step"], r0["knob/hack_norm"], rel_tol=1e-5)


def test_erase_leaves_no_hackward_gradient_and_none_measures_only(runs):
    for r in runs["erase"][1]:
        assert r["proj/cin"] > 0.0 and r["proj/cout"] < 1e-5
    for r in runs["none"][1]:
        assert r["proj/cout"] == r["proj/cin"]


def test_teacher_imitation_forces_ratio_one(runs):
    assert all(r["teacher/mode"] == "imitation" and r["teacher/ratio_mean"] == 1.0 for r in runs["erase"][1])


def test_teacher_exclude_gives_teacher_tokens_zero_gradient(runs):
    for call in runs["none"][2].calls:
        assert all(float(g.abs().max()) == 0.0 for g in call["g_t"].values())
        assert any(float(g.abs().max()) > 0.0 for g in call["g_s"].values())
    assert all(r["teacher/is_weight_mean"] == 0.0 for r in runs["none"][1])


def test_teacher_importance_ratio_comes_from_stored_logp(runs):
    # the behaviour policy is another random model, so pi/mu is far from 1; weights are truncated at 1.5
    for r in runs["route"][1]:
        assert r["teacher/mode"] == "importance" and r["teacher/ratio_mean"] != 1.0
        assert 0.0 < r["teacher/is_weight_mean"] <= 1.5 and 0.0 <= r["teacher/clip_frac"] <= 1.0


def test_deploy_rates_are_the_students_unless_the_quarantine_moved(runs):
    # none / erase never write the quarantine knob: the deployed model is the student; nothing sampled twice
    for arm in ("none", "erase"):
        cfg, rows, spy, _ = runs[arm]
        for r in rows:
            assert (r["hack/deploy"], r["solve/deploy"]) == (r["hack/student"], r["solve/student"])
        sampled = [g for g in spy.generations if g["temperature"] > 0]
        assert len(sampled) == cfg.run.steps + sum(r["groups/resample_tries"] for r in rows)
    # route: step 0 starts from a zero quarantine, so one sampled call; step 1, with the quarantine moved,
    # samples the deployed model too (quarantine ablated inside the call), with the students' seed
    cfg, rows, spy, _ = runs["route"]
    sampled = [g for g in spy.generations if g["temperature"] > 0]
    seed_of = sampling_generate.step_seed
    s0, s1 = seed_of(cfg.run.seed, 0, 0), seed_of(cfg.run.seed, 1, 0)
    assert [(g["seed"], g["hack_norm"] > 0) for g in sampled] == [(s0, False), (s1, True), (s1, True)]
    assert all(0.0 <= r["hack/deploy"] <= 1.0 and 0.0 <= r["solve/deploy"] <= 1.0 for r in rows)


def test_route_deploy_eval_and_v_refresh_are_logged(runs):
    rows = runs["route"][1]
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in ("eval/hack", "eval/accuracy", "eval/format"))
    assert "proj/v_overlap" not in rows[0] and 0.0 <= rows[1]["proj/v_overlap"] <= 1.0 + 1e-6


def test_chunks_split_the_kept_groups_into_micro_batches():
    from projected_grpo.run.batches import Batch

    zero = torch.tensor([False, True, False, False, False, False])
    b = Batch(0, "train", [], [[]] * 6, torch.zeros(6, 2), zero, [])
    # kept: 0, 2, 3, 4, 5 (1 is zero-variance); micro 2 -> [0, 2], [3, 4], [5]
    assert b.chunks(2) == [[0, 2], [3, 4], [5]] and b.chunks(4) == [[0, 2, 3, 4], [5]]
    b.shard = range(3, 6)  # a rank's own groups only
    assert b.chunks(2) == [[3, 4], [5]]


def test_gradient_accumulation_matches_one_big_batch(runs, tmp_path):
    # Aggregations take the whole step's Denominators, so micro-batch losses sum to the full-batch loss.
    grads = {}
    for micro in (1, 2):
        cfg = C.replace(runs["erase"][0], rollout={"micro_prompts": micro}, run={"steps": 1,
                        "dir": str(tmp_path / f"m{micro}")})
        with pytest.MonkeyPatch.context() as mp:
            spy = Spy(mp)
            T.train(cfg)
        grads[micro] = spy.calls[0]["g"]
    for n in grads[2]:
        torch.testing.assert_close(grads[1][n], grads[2][n], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("buckets", [1, 3])
def test_shared_prefix_gives_the_packed_forwards_gradients(runs, tmp_path, buckets):
    # rollout.share_prefix (sampling/prefix.py) changes how the scoring forwards run, not the math, and so do
    # its like-length buckets (rollout.buckets): with teacher rows, importance ratios and a KL term, step 0's
    # gradient and its per-source split agree to fp32
    calls = {}
    for share in (True, False):
        cfg = C.replace(runs["route"][0], rollout={"share_prefix": share, "buckets": buckets},
                        run={"steps": 1, "eval_every": 0, "dir": str(tmp_path / f"share{share}")})
        seen = []
        with pytest.MonkeyPatch.context() as mp:
            spy = Spy(mp)
            mp.setattr(prefix, "length_buckets", lambda lens, k, seen=seen:
                       seen.append(pack.length_buckets(lens, k)) or seen[-1])
            T.train(cfg)
        calls[share] = spy.calls[0]
        assert max((len(g) for g in seen), default=0) == (buckets if share else 0)  # the buckets did run
    for key in ("g", "g_s", "g_t"):  # max |diff| / max |g| per module: fp32 rounding, near-cancelling sums
        for n, want in calls[False][key].items():
            assert (calls[True][key][n] - want).abs().max() <= 1e-5 * want.abs().max(), (key, n)


def test_zero_variance_groups_are_resampled_then_skipped(runs, tmp_path):
    # mix 0: no teacher rows, and the random smoke model never earns a reward, so every group has zero
    # variance; resample regenerates them twice, then the step is skipped: no optimizer step at all.
    cfg = C.replace(runs["erase"][0], rollout={"mix": 0.0}, loss={"zero_var": "resample", "max_resample": 2},
                    run={"steps": 1, "dir": str(tmp_path / "zv")})
    T.train(cfg)
    (row,) = metrics.read_rows(tmp_path / "zv/metrics.jsonl")
    assert (row["groups/resample_tries"], row["groups/resampled"], row["groups/skipped"]) == (2.0, 4.0, 2.0)
    assert row["knob/norm"] == 0.0 and row["teacher/frac"] == 0.0


def test_drifted_pool_is_refused(runs, tmp_path):
    cfg = runs["erase"][0]
    text = (pathlib.Path(cfg.run.dir) / "pool.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    ids = rows[0]["prompt_ids"]
    rows[0]["prompt_ids"] = ids[:3] + [ids[3] + 1] + ids[4:]  # one token re-encoded as another
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = C.replace(cfg, pool={"path": str(tmp_path / "pool.jsonl")}, run={"dir": str(tmp_path / "run")})
    with pytest.raises(UserError, match=r"pool\.jsonl:1: tokenization drift for problem"):
        T.train(bad)


def test_nan_token_loss_stops_naming_step_and_source(runs, tmp_path, monkeypatch):
    real = T.TEACHER_MODES["imitation"]

    def poisoned(logp, logp_b, is_student, mask, trunc):  # NaN weight on teacher tokens only
        logp_old, w, stats = real(logp, logp_b, is_student, mask, trunc)
        return logp_old, torch.where(is_student[:, None], w, torch.full_like(w, math.nan)), stats

    monkeypatch.setitem(T.TEACHER_MODES, "imitation", poisoned)
    cfg = C.replace(runs["erase"][0], run={"dir": str(tmp_path / "run")})
    with pytest.raises(FloatingPointError, match=r"step 0: non-finite token loss in a teacher row"):
        T.train(cfg)


class _NanGrad(torch.autograd.Function):
    """Identity forward; NaN gradient on the rows of `rows` (a finite loss whose backward blows up)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return torch.where(rows[:, None], torch.full_like(g, math.nan), g), None


def test_nan_gradient_stops_naming_step_source_and_module(runs, tmp_path, monkeypatch):
    real = T.clip_surrogate

    def poisoned(logp, *args, **kw):
        return real(_NanGrad.apply(logp, torch.arange(logp.shape[0]) == logp.shape[0] - 1), *args, **kw)

    monkeypatch.setattr(T, "clip_surrogate", poisoned)  # a micro-batch's last row is a teacher row
    cfg = C.replace(runs["erase"][0], run={"dir": str(tmp_path / "run")})
    with pytest.raises(FloatingPointError, match=r"step 0: non-finite gradient from the .*teacher rows in m"):
        T.train(cfg)


def test_existing_run_dir_needs_resume(runs):
    with pytest.raises(UserError, match="holds a run: pass --resume"):
        T.train(runs["erase"][0])


def test_resume_with_changed_config_is_refused(runs):
    cfg = C.replace(runs["erase"][0], run={"resume": True}, loss={"beta": 0.5})
    with pytest.raises(UserError, match=r"another config: \['loss.beta: 0.0 -> 0.5'\]"):
        T.train(cfg)


def test_reward_means_agree_under_the_ground_truth_penalty(runs, tmp_path):
    # reward/mean is over all B·G rows, so it is the G_s : G_t weighted mean of the two source means; with
    # a hack penalty all three must be the penalised rewards (the smoke pool's teacher hacks are penalised)
    cfg = C.replace(runs["erase"][0], run={"dir": str(tmp_path / "pen")},
                    monitor={"kind": "ground_truth", "intervention": "penalty", "penalty": 1.0})
    T.train(cfg)
    rows = metrics.read_rows(tmp_path / "pen" / "metrics.jsonl")
    assert any(r["hack/teacher"] > 0 for r in rows)
    R = cfg.rollout
    for r in rows + [r for _, rs, _, _ in runs.values() for r in rs]:
        mixed = (R.G_s * r["reward/student_mean"] + R.G_t * r["reward/teacher_mean"]) / R.group_size
        assert r["reward/mean"] == pytest.approx(mixed, abs=1e-6)


def test_moved_run_dir_resumes_and_a_longer_run_says_the_schedule_moved(runs, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(runs["erase"][0].run.dir, moved)
    cfg = C.replace(runs["erase"][0], run={"resume": True, "dir": str(moved), "steps": 3})
    T.train(cfg)
    assert [r["step"] for r in metrics.read_rows(moved / "metrics.jsonl")] == [0, 1, 2]
    assert "run.steps 2 -> 3: the cosine LR schedule now spans 3 steps" in capsys.readouterr().err
