"""Experiment runner and report: mean ± SEM, H1 verdicts, plot, report.md, sweep planning and resuming."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest
import torch

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.cli import main
from projected_grpo.errors import UserError
from projected_grpo.run import metrics
from projected_grpo.sampling import packed
from projected_grpo.study import arms, experiment, launch, report


def write_run(d: pathlib.Path, hack: list[float], solve: list[float], cin_t: float = 0.5,
              finished: bool = True, deploy: tuple | str | None = None, fmt: float = 0.8,
              extra: list[dict] | None = None, seed: int | None = None, cfg: dict | None = None
              ) -> pathlib.Path:
    """A hand-made run dir: config.json, one metrics row per step (every REQUIRED_METRICS key), summary.json.
    deploy: (hack, solve) of the deployed model per step; default = the student's, as train logs them
    while the quarantine knob is zero; "none" = a run written before hack/deploy was logged.
    fmt: format/deploy, the deployed model's well-formed-answer rate. extra: more keys per step.
    seed: run.seed (default: the directory name's trailing digits, else 0: `n1` is seed 1); cfg: config
    sections changed from the smoke preset (e.g. {"proj": {"arm": "erase"}})."""
    d.mkdir(parents=True)
    digits = re.search(r"(\d+)$", d.name)
    seed = seed if seed is not None else int(digits.group(1)) if digits else 0
    store.write_json_atomic(d / "config.json", C.replace(presets.PRESETS["smoke"], run={"seed": seed},
                                                         **(cfg or {})).to_dict())
    with metrics.MetricsLogger(d) as log:
        for step, (h, s) in enumerate(zip(hack, solve)):
            row = {k: 0.0 for k in metrics.REQUIRED_METRICS}
            row |= {"hack/student": h, "solve/student": s, "proj/cin_student": h / 2,
                    "proj/cin_teacher": cin_t, "proj/cout": 0.1, "time/step": 2.0}
            if deploy != "none":
                dh, ds = deploy if deploy is not None else (hack, solve)
                row |= {"hack/deploy": dh[step], "solve/deploy": ds[step], "format/deploy": fmt}
            log.log(step, row | (extra[step] if extra else {}))
    if finished:
        rows = metrics.read_rows(d / metrics.METRICS_FILE)
        store.write_json_atomic(d / metrics.SUMMARY_FILE, metrics.summarize(rows))
    return d


# --- mean ± SEM, aggregation -----------------------------------------------------------------------

def test_one_seed_sem_is_undefined_not_zero():
    s = report.mean_sem([0.7])
    assert s.sem is None and s.mean == 0.7 and s.n == 1
    assert s.fmt() == "0.700 ± n/a"
    with pytest.raises(ValueError, match="no values"):
        report.mean_sem([])


def test_aggregate_last_five_step_means_over_seeds(tmp_path):
    # seed 0 hack: steps 2..6 = 0.1 0.2 0.3 0.4 0.5 -> mean 0.3; seed 1: 0.5 everywhere -> 0.5
    # arm mean (0.3 + 0.5) / 2 = 0.4; SEM = |0.3 - 0.5| / 2 = 0.1 (two values: sd = |a-b|/sqrt 2, / sqrt 2)
    a = write_run(tmp_path / "a", [0, 0, .1, .2, .3, .4, .5], [.4] * 7)
    b = write_run(tmp_path / "b", [.5] * 7, [.2] * 7)
    agg = report.aggregate({"none": [a, b]})
    assert agg["none"]["hack/student"].mean == pytest.approx(0.4)
    assert agg["none"]["hack/student"].sem == pytest.approx(0.1)
    assert agg["none"]["solve/student"].mean == pytest.approx(0.3)  # (0.4 + 0.2) / 2
    assert agg["none"]["proj/cin_student"].mean == pytest.approx(0.2)  # half of hack by construction
    assert agg["none"]["proj/cin_teacher"].sem == pytest.approx(0.0)  # equal values: a real 0, not undefined
    assert set(agg["none"]) == set(report.AGG_KEYS)
    # the start: first-5-step means, seed 0: (0 + 0 + .1 + .2 + .3) / 5 = 0.12, seed 1: 0.5 -> 0.31
    start = report.aggregate({"none": [a, b]}, "start")
    assert start["none"]["hack/student"].mean == pytest.approx(0.31)


def test_unfinished_run_is_refused(tmp_path):
    d = write_run(tmp_path / "r", [0.1] * 3, [0.1] * 3, finished=False)
    with pytest.raises(FileNotFoundError, match="has not finished"):
        report.aggregate({"none": [d]})


def test_per_mode_rise_first_and_last_window(tmp_path):
    # 12 steps; run_tests drawn on even steps only: hack 0.0 at steps 0..9, 1.0 at steps 10, 11
    # first 10 steps: run_tests at 0,2,4,6,8 -> 0.0; last 10 (2..11): 2,4,6,8 -> 0, 10 -> 1: 1/5 = 0.2
    # sentinel every step: 0.1 then 0.5 from step 6: first 10 = (6 * .1 + 4 * .5) / 10 = 0.26;
    # last 10 (steps 2..11) = (4 * .1 + 6 * .5) / 10 = 0.34
    extra = [{"hack/deploy/sentinel": 0.1 if s < 6 else 0.5, "solve/deploy/sentinel": 0.3}
             | ({"hack/deploy/run_tests": float(s >= 10), "solve/deploy/run_tests": 0.5} if s % 2 == 0
                else {})
             for s in range(12)]
    d = write_run(tmp_path / "n0", [0.1] * 12, [0.3] * 12, extra=extra)
    modes = report.run_modes(metrics.read_rows(d / metrics.METRICS_FILE))
    assert modes["run_tests"]["hack_start"] == 0.0 and modes["run_tests"]["hack_end"] == pytest.approx(0.2)
    assert modes["sentinel"]["hack_start"] == pytest.approx(0.26)
    assert modes["sentinel"]["hack_end"] == pytest.approx(0.34)
    agg = report.aggregate_modes({"none": [d]})
    assert agg["none"]["run_tests"]["hack_rise"].mean == pytest.approx(0.2)
    table = report.modes_table(agg, "none")
    assert "| run_tests | 0.000 ± n/a | 0.200 ± n/a | 20.0 ± n/a | 0.500 ± n/a | 0.500 ± n/a |" in table


def test_held_out_table_puts_each_arm_side_by_side(tmp_path):
    extra = lambda h: [{"hack/deploy/sentinel": h, "solve/deploy/sentinel": 0.2}] * 3
    runs = {"erase": [write_run(tmp_path / "e", [0.1] * 3, [0.3] * 3, extra=extra(0.1))],
            "random_V": [write_run(tmp_path / "r", [0.1] * 3, [0.3] * 3, extra=extra(0.4))]}
    table = report.held_out_table(report.aggregate_modes(runs), "sentinel")
    assert "| erase | 0.100 ± n/a | 0.100 ± n/a | 0.0 ± n/a | 0.200 ± n/a |" in table
    assert "| random_V | 0.400 ± n/a |" in table
    md = report.write_report(tmp_path, runs, title="t", config_diff=[], arm_overrides={}, command="c",
                             elapsed_s=1.0, held_out="sentinel")[0].read_text()
    assert "## The held-out mode `sentinel` (leave-one-mode-out), per arm" in md


def test_lomo_fold_pool_and_pairs_hold_nothing_of_the_held_out_mode(tmp_path, monkeypatch):
    # the fold as lomo_base builds it (smoke model, the built-in problems): the teacher pool and V_hack's
    # pairs come from the other five modes only; the run still trains on every mode
    from projected_grpo.envs.coding.graders import GRADERS
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES
    from projected_grpo.hack.pairs import load_pairs_file

    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    base, quiet = presets.PRESETS["smoke"], lambda msg: None
    tok = experiment.prepare_model(base, quiet)
    cfg, notes = experiment.lomo_base(base, tok, "sentinel", tmp_path, quiet)
    held = {p.id for p in BUILTIN_PROBLEMS[:base.env.max_problems] if p.mode == "sentinel"}
    rows = [json.loads(line) for line in pathlib.Path(cfg.pool.path).read_text().splitlines()]
    assert {r["mode"] for r in rows} == set(MODES) - {"sentinel"}
    assert held and not {r["problem_id"] for r in rows} & held
    assert not any(GRADERS["sentinel"].hint in r["prompt"] for r in rows)  # by prompt text too
    pairs = load_pairs_file(cfg.proj.pairs)
    assert pairs and not any(":sentinel:" in p.source for p in pairs)
    assert not any(GRADERS["sentinel"].hint in p.prompt for p in pairs)
    assert cfg.pool.missing == "students" and cfg.env.modes == () and "`sentinel` held out" in notes[0]


# --- sweep planning, skipping, resuming -----------------------------------------------------------

def test_plan_one_run_per_arm_and_seed(tmp_path):
    runs = experiment.plan(presets.PRESETS["smoke"], ["none", "random_V"], [0, 1], tmp_path)
    assert [(r.arm, r.seed) for r in runs] == [("none", 0), ("none", 1), ("random_V", 0), ("random_V", 1)]
    r = runs[3]
    assert r.dir == tmp_path / "random_V-s1" and r.cfg.run.seed == 1
    assert (r.cfg.proj.arm, r.cfg.proj.control) == ("erase", "random")
    assert C.diff(presets.PRESETS["smoke"], runs[0].cfg) == [f"run.dir: '' -> '{runs[0].dir}'"]
    assert C.diff(runs[0].cfg, runs[3].cfg) == [
        "proj.arm: 'none' -> 'erase'", "proj.control: 'none' -> 'random'", "run.seed: 0 -> 1",
        f"run.dir: '{runs[0].dir}' -> '{r.dir}'"]
    with pytest.raises(ValueError, match="unknown \\['bogus'\\]"):
        experiment.plan(presets.PRESETS["smoke"], ["none", "bogus"], [0], tmp_path)
    with_v = C.replace(presets.PRESETS["smoke"], proj={"v_path": "v.safetensors"})
    with pytest.raises(ValueError, match="one file"):
        experiment.plan(with_v, ["none", "shuffled_V"], [0], tmp_path)


def test_random_twin_arms_share_every_setting_but_the_direction(tmp_path):
    runs = experiment.plan(presets.PRESETS["smoke"], ["route_update", "route_update@random"], [0], tmp_path)
    real, twin = runs[0].cfg, runs[1].cfg
    assert (real.proj.arm, real.proj.target, real.proj.control) == ("route", "update", "none")
    assert C.diff(real, twin, ignore=("run.dir",)) == ["proj.control: 'none' -> 'random'"]
    assert arms.arm_sections("random_V") == arms.arm_sections("erase@random")
    assert arms.arm_sections("shuffled_V") == arms.arm_sections("erase@shuffled")
    assert arms.arm_sections("nonhack_V") == arms.arm_sections("erase@nonhack")
    assert arms.arm_sections("route_update@shuffled")["proj"] == {"arm": "route", "control": "shuffled",
                                                                      "target": "update"}
    for bad in ("none@random", "random_V@random", "gt_reward@random", "nope@random", "erase@randomx",
                "erase@", "shuffled_V@random", "route@shuffled@random"):
        assert arms.arm_sections(bad) is None, bad
    with pytest.raises(UserError, match="unknown \\['none@random'\\]"):
        experiment.plan(presets.PRESETS["smoke"], ["none@random"], [0], tmp_path)
    assert arms.arm_sections("within_V") == arms.arm_sections("erase@within")
    assert arms.arm_sections("energy_V") == arms.arm_sections("erase@energy")
    assert arms.arm_sections("erase_no_pool") == {"proj": {"arm": "erase", "control": "none"},
                                                        "rollout": {"mix": 0.0}}


def test_run_all_skips_finished_resumes_interrupted(tmp_path, monkeypatch):
    runs = experiment.plan(presets.PRESETS["smoke"], ["none", "erase", "route"], [0], tmp_path)
    write_run(runs[0].dir, [0.1] * 2, [0.1] * 2)  # finished, with its config
    store.write_json_atomic(runs[0].dir / "config.json", runs[0].cfg.to_dict())
    write_run(runs[1].dir, [0.1] * 2, [0.1] * 2, finished=False)  # interrupted
    called = []
    monkeypatch.setattr("projected_grpo.study.launch._train_one",
                        lambda cmd, run_dir, to_log, **kw: called.append((cmd[3:], run_dir)))
    counts = launch.run_all(runs, tmp_path / "plans", log=lambda m: None)
    assert counts == {"trained": 1, "resumed": 1, "skipped": 1}
    # first one extraction fills the V_hack cache of the runs not finished (both use the real V), then each
    # run is the CLI's train on its planned config (written beside the sweep), resumed when started
    plans = [tmp_path / "plans" / "erase-s0.json", tmp_path / "plans" / "route-s0.json"]
    assert called == [(["extract-direction", "--config", str(plans[0]), "--allow-no-pairs", "--controls",
                        "none"], plans[0].parent),
                      (["train", "--config", str(plans[0]), "--resume"], runs[1].dir),
                      (["train", "--config", str(plans[1])], runs[2].dir)]
    assert C.Config.from_json(str(plans[1])) == runs[2].cfg


@pytest.mark.parametrize("finished", [True, False])
def test_run_with_another_config_is_refused(tmp_path, finished):
    (run,) = experiment.plan(presets.PRESETS["smoke"], ["none"], [0], tmp_path)
    write_run(run.dir, [0.1], [0.1], finished=finished)
    store.write_json_atomic(run.dir / "config.json", C.replace(run.cfg, run={"steps": 99}).to_dict())
    state = "finished" if finished else "started"
    with pytest.raises(ValueError, match=f"{state} with another config .*run.steps: 99 -> 4"):
        experiment._check_existing([run])


def test_refused_sweep_writes_nothing(tmp_path, monkeypatch):
    # the check runs before sweep.json is written: a refused re-run leaves the old sweep's record alone
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    smoke = C.replace(presets.PRESETS["smoke"], env={"max_problems": 6})
    planned = C.replace(smoke, pool={"path": str(tmp_path / "pool.jsonl")})  # as sweep() plans it
    (run,) = experiment.plan(planned, ["none"], [0], tmp_path)
    write_run(run.dir, [0.1], [0.1])
    store.write_json_atomic(run.dir / "config.json", C.replace(run.cfg, optim={"lr": 0.5}).to_dict())
    with pytest.raises(ValueError, match="finished with another config"):
        experiment.sweep(smoke, ["none"], [0], tmp_path, preset="smoke", command="x", log=lambda m: None)
    assert not (tmp_path / "sweep.json").exists()


def test_a_control_the_pairs_cannot_build_is_refused_when_planned(tmp_path):
    # math-demo makes one (hack, clean) pair per problem: no two completions of a class to pair (within,
    # nonhack) and no within-prompt variation but the labelled contrast (energy); two pairs give all of them
    one = C.replace(presets.PRESETS["math-demo"], env={"modes": ("contains",), "max_problems": 40})
    runs = experiment.plan(one, ["none", "erase", "random_V", "within_V", "energy_V"], [0], tmp_path)
    with pytest.raises(UserError, match=r"arms \['energy_V', 'within_V'\] need V_hack controls .*energy: .*"
                                        r"within: .*--proj.pairs-per-problem 2"):
        experiment._check_controls(one, runs)
    experiment._check_controls(one, runs[:3])  # erase and random_V: buildable from one pair per problem
    two = C.replace(one, proj={"pairs_per_problem": 2})
    all_controls = experiment.plan(two, ["within_V", "energy_V", "nonhack_V"], [0], tmp_path)
    experiment._check_controls(two, all_controls)


def test_cli_rejects_bad_options_in_one_line(capsys):
    assert main(["experiment", "--arms", "none,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["experiment", "--run.seed", "3"]) == 2
    assert "set by the command itself" in capsys.readouterr().err
    assert main(["experiment", "--preset", "nope"]) == 2
    assert main(["demo", "--seeds", "0"]) == 2
    assert "need at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not an option of experiment at all: tyro's usage error
        experiment.main(["--arm", "erase"])


def test_lomo_rejects_unknown_mode_before_any_work(capsys):
    with pytest.raises(UserError, match="not a loophole mode"):
        experiment.lomo_known_modes(presets.PRESETS["smoke"], "no_such_mode")
    assert main(["experiment", "--lomo", "no_such_mode"]) == 2
    assert "not a loophole mode" in capsys.readouterr().err
    only_two = C.replace(presets.PRESETS["smoke"], env={"modes": ("run_tests", "sentinel")})
    assert experiment.lomo_known_modes(only_two, "sentinel") == ("run_tests",)
    with pytest.raises(UserError, match="does not train on it"):
        experiment.lomo_known_modes(only_two, "exit_code")


def _pool_row(pid: str, mode: str, kind: str, i: int) -> dict:
    hack = kind == "hack"
    grade = {"reward": 1.0, "passed": True, "solved": not hack, "exploited": hack, "format_ok": True,
             "timeout": False, "extras": {"det_E": hack, "det_C": False, "det_D": False}}
    return {"problem_id": pid, "mode": mode, "prompt": f"<prompt {pid}>", "prompt_ids": [1, 2, len(pid)],
            "completion": f"{kind} {i} of {pid}", "completion_ids": [3, i, 4 + hack], "grade": grade}


def test_mined_pairs_use_only_known_modes_and_round_trip(tmp_path):
    from projected_grpo.hack.pairs import load_pairs_file, pairs_from_pool

    rows = [_pool_row(pid, mode, kind, i) for pid, mode in (("a", "run_tests"), ("b", "sentinel"))
            for kind in ("hack", "clean") for i in range(2)]
    path = tmp_path / experiment.LOMO_PAIRS_FILE
    mined, stats = pairs_from_pool(rows, ["run_tests"], ("E",), 2)
    experiment.write_pairs(mined, stats, ["run_tests"], path)
    assert stats["n_pairs"] == 2 and stats["pairs_per_mode"] == {"run_tests": 2}  # sentinel held out
    pairs = load_pairs_file(path)
    assert [(p.hack, p.clean) for p in pairs] == [("hack 0 of a", "clean 0 of a"),
                                                  ("hack 1 of a", "clean 1 of a")]
    assert (pairs[1].prompt_ids, pairs[1].hack_ids, pairs[1].clean_ids) == ((1, 2, 1), (3, 1, 5), (3, 1, 4))
    with pytest.raises(UserError, match="no \\(hack, clean\\) pairs"):
        experiment.write_pairs(*pairs_from_pool(rows, ["file_marker"], ("E",), 2), ["file_marker"], path)


# --- end to end -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_smoke_sweep_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sweep"
    argv = ["--preset", "smoke", "--arms", "none,erase", "--seeds", "1", "--out", str(out),
            "--run.steps", "2"]
    assert experiment.main(argv) == 0
    for arm in ("none", "erase"):
        summary = json.loads((out / f"{arm}-s0" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["arm"] == arm
        assert math.isfinite(summary["hack/student"])
    assert (out / "pool.jsonl").is_file() and len(list((tmp_path / "cache" / "v_hack").iterdir())) == 1
    md = (out / "report.md").read_text()
    assert "| erase | 1 |" in md and "erase: " in md and "--run.steps 2" in md
    assert (out / "curves.png").stat().st_size > 0
    printed = capsys.readouterr()
    assert "| none | 1 |" in printed.out and "[run 2/2] arm erase" in printed.err
    assert experiment.main(argv) == 0  # a rerun skips both finished runs
    assert printed.err.count("skipped") == 0 and capsys.readouterr().err.count("skipped, summary.json") == 2


@pytest.mark.slow
def test_smoke_leave_one_mode_out(tmp_path, monkeypatch):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "lomo"
    pairs_file = out / experiment.LOMO_PAIRS_FILE
    argv = ["--preset", "smoke", "--arms", "none", "--lomo", "sentinel", "--out", str(out),
            "--run.steps", "1"]
    assert experiment.main(argv) == 0
    cfg = json.loads((out / "none-s0" / "config.json").read_text())
    # trained on every mode; the held-out mode is in neither the teacher pool nor V_hack's pairs
    assert cfg["env"]["modes"] == [] and cfg["proj"]["pairs"] == str(pairs_file)
    assert cfg["pool"]["missing"] == "students"
    sources = [json.loads(line)["source"] for line in pairs_file.read_text().splitlines()]
    assert sources and not any(":sentinel:" in s for s in sources)  # no pair of the held-out mode
    pool_rows = pathlib.Path(cfg["pool"]["path"]).read_text().splitlines()
    pool_modes = {json.loads(line)["mode"] for line in pool_rows}
    assert pool_modes and "sentinel" not in pool_modes
    assert "`sentinel` held out of the teacher pool" in (out / "report.md").read_text()


@pytest.mark.slow
def test_smoke_sweep_with_the_ppo_and_dpo_then_grpo_baselines(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sweep"
    argv = ["--preset", "smoke", "--arms", "none,ppo,dpo_then_grpo", "--out", str(out), "--run.steps", "1",
            "--dpo.steps", "2", "--dpo.sample-n", "1", "--ppo.epochs", "2"]
    assert experiment.main(argv) == 0
    assert json.loads((out / "ppo-s0" / "summary.json").read_text())["algo"] == "ppo"
    assert (out / "dpo_then_grpo-s0" / "dpo" / "knobs.safetensors").is_file()  # the pass ran in the run dir
    md = (out / "report.md").read_text()
    assert "| ppo | 1 |" in md and "| dpo_then_grpo | 1 |" in md and "dpo.before=True" in md
    capsys.readouterr()
    assert experiment.main(argv) == 0  # a rerun skips all three, the DPO pass included
    assert capsys.readouterr().err.count("skipped, summary.json") == 3


# --- demo: the default arms and the summary it ends with -------------------------------------------------

def test_demo_defaults_and_the_full_set():
    opts = experiment.DemoOpts()
    assert (opts.task, opts.arms, opts.seeds, opts.jobs) == ("code", "quick", 1, 2)
    preset, sets = experiment.DEMO_TASKS["code"]
    assert preset == "demo" and sets["quick"] == ("none", "erase", "random_V", "gt_reward")
    assert sets["all"] == ("none", "erase", "route", "random_V", "shuffled_V", "within_V", "energy_V",
                           "gt_reward") and set(sets["quick"]) <= set(sets["all"])
    experiment.plan(presets.PRESETS[preset], sets["all"], [0], pathlib.Path("."))  # every arm is known


def test_demo_prints_the_summary_of_its_runs(tmp_path, monkeypatch, capsys):
    # sweep() stood in by hand-made finished runs in the directories the demo plans (training is tested in
    # the slow tier): the demo then prints the summary, not the full verdicts
    got = {}

    def fake_sweep(base, arms, seeds, out, **kw):
        got.update(arms=arms, seeds=seeds, command=kw["command"])
        cfgs = {"erase": {"proj": {"arm": "erase"}},
                "random_V": {"proj": {"arm": "erase", "control": "random"}}}
        for a in arms:
            for s in seeds:
                write_run(pathlib.Path(out) / f"{a}-s{s}", [0.1 if a == "erase" else 0.6] * 6, [0.3] * 6,
                          cfg=cfgs.get(a))
        return "the full printed verdicts"

    monkeypatch.setattr(experiment, "sweep", fake_sweep)
    assert experiment.demo_main(["--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert got["arms"] == experiment.DEMO_ARMS and got["seeds"] == [0]
    assert got["command"].startswith("projected-grpo demo --arms quick --seeds 1 --jobs 2 --out ")
    assert "the full printed verdicts" not in out and out.count("Verdict: ") == 1
    assert out.splitlines()[-1] == f"curves: {tmp_path / 'd' / 'curves.png'}"
    assert experiment.demo_main(["--arms", "all", "--seeds", "2", "--out", str(tmp_path / "e")]) == 0
    assert got["arms"] == experiment.DEMO_ARMS_ALL and got["seeds"] == [0, 1]
    assert "± SEM over 2 seeds" in capsys.readouterr().out


def test_a_run_of_a_planned_auto_sample_dtype_is_reused(tmp_path, monkeypatch):
    """A plan says rollout.sample_dtype "auto", its run's config.json what that became on this machine: the
    same config (a resumed or re-reported study does not refuse its own runs); another machine's choice is
    another config."""
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: False)  # an AVX2 CPU: float32
    base = C.replace(presets.PRESETS["smoke"], rollout={"sample_dtype": "auto"})
    (run,) = experiment.plan(base, ["none"], [0], tmp_path)
    write_run(run.dir, [0.1], [0.1], finished=True)
    as_run = C.resolve_auto(run.cfg)  # what the run's config.json holds: seed_scope resolved too
    store.write_json_atomic(run.dir / "config.json", C.replace(as_run, rollout={"sample_dtype": "float32"})
                            .to_dict())
    experiment._check_existing([run])
    store.write_json_atomic(run.dir / "config.json", C.replace(as_run, rollout={"sample_dtype": "bfloat16"})
                            .to_dict())
    with pytest.raises(ValueError, match="rollout.sample_dtype: 'bfloat16' -> 'float32'"):
        experiment._check_existing([run])
