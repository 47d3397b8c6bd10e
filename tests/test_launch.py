"""Sweeps in parallel (study/launch.py) and the whole study in one command (study/preregistered.py): the
default --jobs formula, backends, and (slow) a Ray sweep against the local backend, a resumed Ray sweep, and
a reduced study end to end."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.cli import main
from projected_grpo.errors import UserError
from projected_grpo.run import checkpoint, metrics
from projected_grpo.study import experiment, launch, preregistered

TIME_KEYS = ("time/generate", "time/grade", "time/backward", "time/step")
SMALL = ["--run.steps", "2", "--env.max-problems", "6", "--rollout.max-new-tokens", "8"]


# --- how many runs at once ------------------------------------------------------------------------------

def test_default_jobs_is_cores_over_each_runs_threads():
    one = experiment.plan(presets.SMOKE, ["none", "erase"], [0], pathlib.Path("x"))  # run.threads = 1
    assert launch.run_cpus(one) == 1
    assert launch.default_jobs(1, n_cores=2) == 2  # 2 // 1: the 2-core laptop runs two at once
    assert launch.default_jobs(3, n_cores=8) == 2  # 8 // 3 = 2
    assert launch.default_jobs(4, n_cores=2) == 1  # never 0
    threads = lambda n: experiment.plan(C.replace(presets.SMOKE, run={"threads": n}), ["none"], [0],
                                        pathlib.Path("x"))
    assert launch.run_cpus(threads(3) + one) == 3  # the hungriest run sets the request
    assert launch.run_cpus(threads(0)) == launch.cores()  # 0 = torch's default: every core


def test_unknown_backend_and_missing_ray_are_one_line_errors(tmp_path, monkeypatch, capsys):
    runs = experiment.plan(presets.SMOKE, ["none"], [0], tmp_path)
    with pytest.raises(UserError, match="--backend 'slurm'"):
        launch.run_all(runs, tmp_path / "plans", log=lambda m: None, backend="slurm")
    assert main(["experiment", "--backend", "slurm"]) == 2
    assert "choose one of ['local', 'ray']" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without the extra looks like
    with pytest.raises(UserError, match=r"pip install 'projected-grpo\[ray\]'"):
        launch.run_all(runs, tmp_path / "plans", log=lambda m: None, backend="ray")


def test_plans_of_several_sweeps_go_beside_each_sweep(tmp_path, monkeypatch):
    a = experiment.plan(presets.SMOKE, ["none"], [0], tmp_path / "main")
    b = experiment.plan(presets.SMOKE, ["none"], [0], tmp_path / "lomo-sentinel")
    called = []
    monkeypatch.setattr(launch, "_train_one", lambda cmd, run_dir, to_log, **kw: called.append(cmd[3:6]))
    launch.run_all(a + b, None, log=lambda m: None)  # same arm and seed in two sweeps: two plan files
    plans = [str(tmp_path / d / "plans" / "none-s0.json") for d in ("main", "lomo-sentinel")]
    # one V_hack extraction serves both (alike V inputs, the same seed), then the two runs
    assert called == [["extract-direction", "--config", plans[0]], ["train", "--config", plans[0]],
                      ["train", "--config", plans[1]]]


def test_runs_alike_but_for_control_and_seed_share_one_extraction(tmp_path):
    """v_hack_groups: one extraction per group of runs whose V_hack inputs differ only in the control (a
    seed each: the model, problems and knobs may be drawn with it), asking for every control of the group;
    another pairs setting is another group; a run with its own V file needs none."""
    arms = ["none", "erase", "random_V", "shuffled_V", "within_V"]
    runs = experiment.plan(presets.SMOKE, arms, [0, 1, 2], tmp_path / "a")
    other = experiment.plan(C.replace(presets.SMOKE, proj={"pairs_per_problem": 2}), ["erase"], [0],
                            tmp_path / "b")
    own = experiment.plan(C.replace(presets.SMOKE, proj={"v_path": str(tmp_path / "v.safetensors")}),
                          ["erase"], [0], tmp_path / "c")
    planned = [(r, tmp_path / f"{i}.json") for i, r in enumerate(runs + other + own)]
    groups = launch.v_hack_groups(planned)
    every = ["none", "random", "shuffled", "within"]
    assert [(c, s, n) for _, c, s, n in groups] == [(every, [0], 5), (every, [1], 5), (every, [2], 5),
                                                    (["none"], [], 1)]
    assert groups[3][0] == tmp_path / f"{len(runs)}.json"  # the other pairs setting's own plan
    assert launch.extract_command(tmp_path / "p.json", ["none", "random"], [0, 2])[3:] == [
        "extract-direction", "--config", str(tmp_path / "p.json"), "--allow-no-pairs", "--controls", "none",
        "random", "--seeds", "0", "2"]


# --- the study's parts ----------------------------------------------------------------------------------

def test_study_parts_are_the_preregistered_arms_then_one_fold_per_mode():
    parts = preregistered.parts(presets.PRESETS["demo"], ["none", "erase"])
    assert parts[0] == preregistered.Part("main", "", preregistered.PREREGISTERED_ARMS)
    # the plan's arms and controls, the label and energy-matched controls, no_pool and erase_no_pool (F5),
    # the positive control; every other arm only when asked
    assert set(parts[0].arms) == {"none", "erase", "route", "random_V", "shuffled_V", "nonhack_V", "within_V",
                                  "energy_V", "no_pool", "erase_no_pool", "gt_reward"}
    every = preregistered.parts(presets.PRESETS["demo"], ["erase"], ["sentinel"], arms=list(experiment.ARMS))
    assert every[0].arms == tuple(experiment.ARMS)
    # the demo preset trains on all six modes: one fold each, in the environment's mode order
    from projected_grpo.envs.coding.problems import MODES

    assert [(p.name, p.lomo, p.arms, p.borrowed) for p in parts[1:]] == [
        (f"lomo-{m}", m, ("none", "erase"), ("gt_reward",)) for m in MODES]  # none asked for: trained
    assert len(preregistered.parts(presets.SMOKE, ["none"])) == 1 + 6  # smoke: every mode
    assert len(preregistered.parts(presets.SMOKE, ["none"], ["sentinel"])) == 2
    maths = C.replace(presets.SMOKE, env={"name": "maths"})
    assert [p.name for p in preregistered.parts(maths, ["none"])] == ["main"]  # no loophole modes to hold out
    with pytest.raises(UserError, match="bogus"):
        preregistered.parts(presets.SMOKE, ["none", "bogus"])
    with pytest.raises(UserError, match="bogus"):
        preregistered.parts(presets.SMOKE, ["none"], arms=["none", "bogus"])
    with pytest.raises(UserError, match="not a loophole mode"):
        preregistered.parts(presets.SMOKE, ["none"], ["nope"])


def test_a_fold_borrows_mains_baselines_only_without_teacher_rows_in_training():
    default = preregistered.LOMO_ARMS
    assert default == ("erase", "random_V")  # the projection arm beside its random-V twin (issue 14 item 6)
    # demo: mix 0, so holding a mode out changes only V_hack and its pairs, which the baselines do not use
    (fold,) = preregistered.parts(presets.PRESETS["demo"], default, ["sentinel"])[1:]
    assert fold.arms == default and fold.borrowed == ("none", "gt_reward")
    (fold,) = preregistered.parts(presets.PRESETS["demo"], default, ["sentinel"], arms=["none", "erase"])[1:]
    assert fold.borrowed == ("none",)  # only what main trains
    # demo-pool: teacher rows in the groups, and the fold's pool lacks the held-out mode: its own `none`
    (fold,) = preregistered.parts(presets.PRESETS["demo-pool"], default, ["sentinel"])[1:]
    assert fold.arms == ("none", *default) and fold.borrowed == ()


def test_the_bench_part_borrows_what_main_trains():
    bench = ["penalty:ground_truth", "screen:direction", "screen:direction@random", "erase"]
    *_, part = preregistered.parts(presets.PRESETS["demo"], ["erase"], ["sentinel"], bench=bench)
    # none and gt_reward are main's (as erase is): the bench trains only its own arms
    assert part == preregistered.Part("interventions", "", ("penalty:ground_truth", "screen:direction",
                                                            "screen:direction@random"),
                                      ("none", "gt_reward", "erase"))
    *_, part = preregistered.parts(presets.PRESETS["demo"], ["erase"], ["sentinel"], arms=["erase"],
                                   bench=["inoculation"])
    assert part.arms == ("none", "gt_reward", "inoculation") and part.borrowed == ()
    # the default bench: every intervention x monitor arm, inoculation, erase_bounded, and random-V twins of
    # the arms V_hack acts in
    assert {"penalty:ground_truth", "screen:probe", "advantage:direction", "inoculation", "erase_bounded",
            "screen:direction@random", "erase_bounded@random"} <= set(preregistered.BENCH_ARMS)
    assert "screen:probe@random" not in preregistered.BENCH_ARMS
    with pytest.raises(UserError, match="bogus"):
        preregistered.parts(presets.SMOKE, ["none"], ["sentinel"], bench=["bogus"])


def test_arms_with_equal_configs_are_trained_once():
    arms = ["none", "erase", "no_pool", "gt_reward"]
    demo = experiment.plan(presets.PRESETS["demo"], arms, [0, 1], pathlib.Path("x"))
    assert preregistered.same_runs(demo) == {"no_pool": "none"}  # demo has mix 0: no_pool is none
    with_erase = experiment.plan(presets.PRESETS["demo"], [*arms, "erase_no_pool"], [0], pathlib.Path("x"))
    assert preregistered.same_runs(with_erase) == {"no_pool": "none", "erase_no_pool": "erase"}
    pool = experiment.plan(presets.PRESETS["demo-pool"], arms, [0, 1], pathlib.Path("x"))
    assert preregistered.same_runs(pool) == {}  # mix 0.5: no_pool drops the teacher rows


def test_no_pool_arm_is_pure_student_grpo():
    (run,) = experiment.plan(presets.PRESETS["demo"], ["no_pool"], [0], pathlib.Path("x"))
    assert run.cfg.rollout.G_t == 0 and run.cfg.rollout.G_s == run.cfg.rollout.group_size
    assert run.cfg.proj.arm == "none"


# --- slow: Ray against the local backend, resume, the study end to end ------------------------------------

def _rows(run_dir: pathlib.Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIME_KEYS}
            for r in metrics.read_rows(run_dir / metrics.METRICS_FILE)]


@pytest.mark.slow
def test_ray_sweep_equals_the_local_backend_and_resumes_only_missing_runs(tmp_path, capsys):
    pytest.importorskip("ray")
    argv = ["--preset", "smoke", "--arms", "none,erase", "--seeds", "1", *SMALL]
    assert experiment.main([*argv, "--out", str(tmp_path / "local"), "--jobs", "2"]) == 0
    table_local = capsys.readouterr().out.split("report:")[0]
    # a local Ray instance (this machine's cores), each run a task requesting run.threads CPUs
    assert experiment.main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray"]) == 0
    out = capsys.readouterr()
    assert out.out.split("report:")[0] == table_local  # the same results table and verdicts
    assert "as Ray tasks of 1 CPU(s) each on a local instance" in out.err
    for arm in ("none", "erase"):
        assert _rows(tmp_path / "ray" / f"{arm}-s0") == _rows(tmp_path / "local" / f"{arm}-s0")
        assert (tmp_path / "ray" / f"{arm}-s0" / launch.LOG_FILE).is_file()  # its output, as today
    # a sweep killed before one run finished: rerun on Ray, only that run is trained
    shutil.rmtree(tmp_path / "ray" / "erase-s0")
    assert experiment.main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray"]) == 0
    out = capsys.readouterr()
    assert out.err.count("skipped, summary.json exists") == 1 and "1 runs as Ray tasks" in out.err
    assert out.out.split("report:")[0] == table_local
    assert _rows(tmp_path / "ray" / "erase-s0") == _rows(tmp_path / "local" / "erase-s0")


@pytest.mark.slow
def test_study_end_to_end_then_a_rerun_skips_everything(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["--preset", "smoke", "--seeds", "1", "--out", str(out), "--lomo-modes", "sentinel", "--lomo-arms",
            "none,erase", "--interventions", "penalty:ground_truth,inoculation", "--proj.pairs-per-problem",
            "2", "--run.steps", "1", *SMALL[2:]]
    assert preregistered.main(argv) == 0
    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    # the bench: its two arms trained, none and gt_reward main's, one table
    assert "## The intervention bench" in md and "| penalty | ground_truth | per-sample | 1 |" in md
    assert "| inoculation | - | none | 1 |" in md and "| none | - | none | 1 |" in md
    # under it the evasion table: the monitor's recall early and late, each arm's hack and its detectors
    assert "## Is the monitor evaded?" in md and "| penalty | ground_truth | 1 | " in md
    # and the follow-up: chosen on seed 0 (every arm ran it), the more-seeds list ends with the baselines
    assert "## More seeds, and the goal" in md and "- Chosen on seeds 0, which every arm ran." in md
    assert "`none`, `gt_reward`." in md
    assert (out / "interventions" / "inoculation-s0" / "summary.json").is_file()
    assert not (out / "interventions" / "none-s0").exists()
    assert "[main](main/report.md)" in md and "[lomo-sentinel](lomo-sentinel/report.md)" in md
    for arm in preregistered.PREREGISTERED_ARMS:  # one table of every arm and fold
        assert f"| {arm} | 1 |" in md and (out / "main" / f"{arm}-s0" / "summary.json").is_file()
    assert "| erase (without sentinel) | 1 |" in md and "### lomo-sentinel" in md
    assert (out / "main" / "report.md").is_file() and (out / "lomo-sentinel" / "curves.png").is_file()
    assert json.loads((out / "lomo-sentinel" / "sweep.json").read_text())["lomo"] == "sentinel"
    assert "| none (without sentinel) | 1 |" in printed
    # every projection arm's word with every falsifier: main's F6 reads the sentinel fold; the paired lines
    # against each control twin; V_hack's held-out check beside its controls
    main_md = md[md.index("### main"):md.index("### lomo-sentinel")]
    erase = main_md[main_md.index("- erase: "):main_md.index("- route: ")]
    for clause in ("H1", "F1", "F2", "F3", "F4", "F5", "F6", "F7"):
        assert f"- {clause} (" in erase, clause
    assert "F6 (capability lost on the held-out mode (its solve down > 15 pts)): " in erase
    f6 = erase.split("F6 (")[1].split("\n")[0]
    assert "sentinel" in f6 and "no leave-one-mode-out fold" not in f6  # decided, or: not drawn in 1 step
    for twin in ("random_V", "shuffled_V", "nonhack_V", "within_V", "energy_V"):
        assert f"- F4 (the arm ≈ control V {twin})" in erase and f"ours: paired vs {twin}: " in erase
    # the one line in the verdicts; the check in full (every control V's row) in the part's own report
    assert "ours: V_hack held-out check " in erase and "(held-out separation: real " in erase
    main_report = (out / "main" / "report.md").read_text()
    assert "V_hack held-out separation" in main_report and "energy V" in main_report
    assert preregistered.main(argv) == 0  # resumes: every run finished, so all are skipped
    n = len(preregistered.PREREGISTERED_ARMS) + 2 + 2
    assert f"trained 0, resumed 0, skipped {n} as finished" in (out / "report.md").read_text()
    # the follow-up's command plans seeds 1-4 of exactly the arms it names (no fold arm): read back with
    # --report-only, which trains nothing and lists every planned run not finished
    more = md.split("- More seeds for: ")[1].split(".\n")[0]
    chosen = {a.strip("`") for a in more.split(", ")}
    nxt = md.split("- To train them (seeds 0-4; finished runs are kept): `")[1].split("`")[0]
    assert preregistered.main([*shlex.split(nxt)[2:], "--report-only"]) == 0
    assert "--lomo-modes none" in nxt and "lomo-sentinel" not in (out / "report.md").read_text()  # no fold
    parts = "\n".join(p.read_text() for p in out.glob("*/report.md"))  # each part's report names its own
    missing = re.findall(r"([\w:@]+) \(missing (\d) of 5\)", parts)
    assert {a for a, _ in missing} == chosen and {k for _, k in missing} == {"4"}


@pytest.mark.slow
def test_study_without_teacher_rows_trains_equal_configs_once_and_folds_borrow_none(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["--preset", "smoke", "--rollout.mix", "0", "--seeds", "1", "--out", str(out), "--arms",
            "none,erase,no_pool", "--lomo-modes", "sentinel", "--interventions", "",
            "--proj.pairs-per-problem", "2", "--run.steps", "1", *SMALL[2:]]
    assert preregistered.main(argv) == 0
    md = (out / "report.md").read_text()
    # 2 runs in main (no_pool is none's config at mix 0) + erase and random_V in the fold
    assert "4 runs; this invocation trained 4" in md and not (out / "main" / "no_pool-s0").exists()
    assert "| no_pool | 1 |" in md  # reported, with none's runs
    assert "arms erase, random_V (borrowed from main: none)" in md and "| none (without sentinel)" not in md
    # (gt_reward is not among --arms here, so only none is borrowed)
    fold = (out / "lomo-sentinel" / "report.md").read_text()
    assert "`none`: main's runs" in fold and str(out / "main" / "none-s0") in fold
    sweep = json.loads((out / "main" / "sweep.json").read_text())
    assert sweep["same"] == {"no_pool": "none"}
    # a study read while it trains: --report-only trains nothing, reports the finished runs, names the rest
    (out / "main" / "erase-s0" / "summary.json").unlink()
    assert preregistered.main([*argv, "--report-only"]) == 0
    md = (out / "report.md").read_text()
    assert "**Partial** (`--report-only`)" in md and "| erase | 1 |" not in md and "| no_pool | 1 |" in md
    assert "PARTIAL: written with `--report-only` while runs were still missing: erase (missing 1 of 1)" in (
        out / "main" / "report.md").read_text()
    assert "--report-only" not in md.split("```")[1]  # the command to resume trains
    assert not (out / "main" / "erase-s0" / "summary.json").exists()  # nothing trained
    # a fold whose arms are all borrowed (`--lomo-arms ''`: none is main's) plans nothing (it was refused)
    capsys.readouterr()
    assert preregistered.main([*argv, "--lomo-arms", "", "--report-only"]) == 0
    err = capsys.readouterr().err
    assert "part lomo-sentinel: 0 arms x 1 seeds, none borrowed from main" in err
    assert "2 runs in 2 parts" in err


# --- slow: a sweep owns its runs (SIGKILL or SIGTERM to it stops them; the same command resumes) -----------

def _train_pids(plans: pathlib.Path) -> list[int]:
    """Live `train --config <plans>/...` processes (the sweep's runs), from /proc."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"train" in argv and any(a.startswith(str(plans).encode()) for a in argv) and state != "Z":
            out.append(int(p.name))
    return out


def _wait_for(cond, what: str, timeout: float = 240.0, sweep: subprocess.Popen | None = None,
              err: pathlib.Path | None = None, out: pathlib.Path | None = None) -> None:
    """Poll `cond` until it holds; fail with the sweep's stderr (`err`, a file) and the logs of its runs
    (under `out`) when the sweep exits first or `timeout` seconds pass: a failure on CI says why."""
    deadline = time.monotonic() + timeout
    while not cond():
        exited = sweep is not None and sweep.poll() is not None
        if exited or time.monotonic() > deadline:
            why = f"the sweep exited ({sweep.returncode})" if exited else f"timed out after {timeout:.0f} s"
            logs = "".join(f"\n--- {p}:\n{p.read_text(errors='replace')[-1500:]}"
                           for p in sorted(out.glob(f"*/{launch.LOG_FILE}"))) if out else ""
            stderr = err.read_text(errors="replace")[-3000:] if err and err.is_file() else ""
            pytest.fail(f"waiting for {what}: {why}\n--- sweep stderr:\n{stderr}{logs}")
        time.sleep(0.05)


def _last_ckpt(run_dir: pathlib.Path) -> int:
    return max((step for step, _ in checkpoint.checkpoints(run_dir)), default=-1)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_killing_a_sweep_stops_every_run_and_the_same_command_resumes(tmp_path):
    out, steps = tmp_path / "sweep", 200  # 200 (~20 s at 0.1 s a step): the leader cannot finish before the
    # other run's first checkpoint, nor between a checkpoint and the SIGTERM
    cmd = [sys.executable, "-m", "projected_grpo.cli", "experiment", "--preset", "smoke", "--arms",
           "none,erase", "--jobs", "2", "--out", str(out), "--run.steps", str(steps),
           "--run.checkpoint-every", "2",
           *SMALL[2:]]
    # any checkpoint, not ckpt-000002: a fast run prunes its first ones (checkpoint.py keeps the newest 3)
    # before a slower-starting one writes its own
    started = lambda: all(_last_ckpt(out / f"{a}-s0") >= 2 for a in ("none", "erase"))

    # SIGKILL: the sweep cannot clean up, so its runs must die with it (the kernel's SIGTERM: PARENT_ENV)
    err_file = tmp_path / "sweep-stderr.txt"  # read only if the wait fails
    with open(err_file, "w") as err_out:
        sweep = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_out)
    _wait_for(started, "both runs' first checkpoint", sweep=sweep, err=err_file, out=out)
    assert len(_train_pids(out / "plans")) == 2
    sweep.kill()
    sweep.wait()
    _wait_for(lambda: not _train_pids(out / "plans"), "the runs of a SIGKILLed sweep to die", timeout=30)

    # SIGTERM mid-step: every run stopped, one line saying how to resume, exit 128 + 15
    sweep = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # on the first checkpoint this command writes: a fast CPU does a step in under 0.1 s, and the runs start
    # seconds apart, so waiting for both runs' checkpoint let the leader finish before the stop (CI, AMD EPYC)
    before = {a: _last_ckpt(out / f"{a}-s0") for a in ("none", "erase")}
    _wait_for(lambda: any(_last_ckpt(out / f"{a}-s0") > before[a] for a in before), "a new checkpoint")
    time.sleep(0.1)
    sweep.send_signal(signal.SIGTERM)
    err = sweep.communicate(timeout=90)[1]
    assert sweep.returncode == 128 + signal.SIGTERM
    assert not _train_pids(out / "plans")  # none survives the sweep
    last = err.strip().splitlines()[-1]
    assert last.startswith("projected-grpo experiment: stopped by SIGTERM: 2 running run(s) stopped, each at "
                           "its last checkpoint; run `projected-grpo experiment --preset smoke")
    assert "Traceback" not in err

    # the same command resumes both from their checkpoints and finishes
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = {}
    for arm in ("none", "erase"):
        run = out / f"{arm}-s0"
        assert [r["step"] for r in metrics.read_rows(run / metrics.METRICS_FILE)] == list(range(steps))
        assert (run / metrics.SUMMARY_FILE).is_file()
        log = (run / launch.LOG_FILE).read_text()
        starts = [int(s) for s in re.findall(r"run \S+ from step (\d+) ", log)]
        assert starts[0] == 0 and 2 <= starts[-1] < steps, starts  # the last command resumed it mid-run
        resumed[arm] = starts[-1]
    assert any(resumed[a] > before[a] for a in before)  # from the checkpoint written before the SIGTERM
