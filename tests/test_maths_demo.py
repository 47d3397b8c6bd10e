"""The held-out eval curves of a sweep: the starting model's eval (study/start_eval.py), the eval table and
plot of report.py, and `projected-grpo demo --task math`'s wiring."""

from __future__ import annotations

import json
import pathlib

import pytest

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.run import metrics
from projected_grpo.study import experiment, report, start_eval


def write_eval_run(d: pathlib.Path, seed: int, acc: list[float], hack: list[float]) -> pathlib.Path:
    """A hand-made finished run dir: 2 * len(acc) steps, eval/* logged every 2nd step (steps 1, 3, ...)."""
    d.mkdir(parents=True)
    store.write_json_atomic(d / "config.json", C.replace(presets.SMOKE, run={"seed": seed}).to_dict())
    with metrics.MetricsLogger(d) as log:
        for step in range(2 * len(acc)):
            row = {k: 0.0 for k in metrics.REQUIRED_METRICS} | {"hack/deploy": 0.0, "solve/deploy": 0.5,
                                                                 "format/deploy": 1.0, "time/step": 1.0}
            if step % 2:
                row |= {"eval/accuracy": acc[step // 2], "eval/hack": hack[step // 2], "eval/format": 1.0}
            log.log(step, row)
    rows = metrics.read_rows(d / metrics.METRICS_FILE)
    store.write_json_atomic(d / metrics.SUMMARY_FILE, metrics.summarize(rows))
    return d


@pytest.fixture
def eval_runs(tmp_path):
    a = write_eval_run(tmp_path / "none-s0", 0, [0.6, 0.8], [0.1, 0.0])
    b = write_eval_run(tmp_path / "none-s1", 1, [0.5, 0.9], [0.0, 0.2])
    start = {0: {"eval/accuracy": 0.5, "eval/hack": 0.1, "eval/format": 1.0},
             1: {"eval/accuracy": 0.4, "eval/hack": 0.0, "eval/format": 1.0}}
    return {"none": [a, b]}, start


def test_eval_table_by_hand(eval_runs):
    runs, start = eval_runs
    (row,) = report.eval_table(runs, start)[2:]
    # start accuracy (0.5 + 0.4) / 2 = 0.45, SEM |0.5 - 0.4| / 2 = 0.05;
    # last eval (0.8 + 0.9) / 2 = 0.85, SEM 0.05
    # change per seed: 80 - 50 = 30 and 90 - 40 = 50 points -> 40.0 ± 10.0
    # hack: start (0.1 + 0.0) / 2 = 0.05 ± 0.05, last (0.0 + 0.2) / 2 = 0.1 ± 0.1
    assert row == "| none | 2 | 0.450 ± 0.050 | 0.850 ± 0.050 | 40.0 ± 10.0 | 0.050 ± 0.050 | 0.100 ± 0.100 |"


def test_eval_section_plots_from_the_start(eval_runs, tmp_path):
    runs, start = eval_runs
    md, printed = report.eval_section(tmp_path, runs, start, "t")
    assert (tmp_path / "eval.png").stat().st_size > 0 and "![held-out accuracy" in md[-2]
    data = report.curves(runs, ("eval/accuracy", "eval/hack"))
    steps, stats = data["none"]["eval/accuracy"]
    assert steps == [1, 3] and [s.mean for s in stats] == pytest.approx([0.55, 0.85])
    fig = report.plot_eval_curves(data, tmp_path / "e.png", "t", report.mean_sem([0.5, 0.4]))
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_xdata()) == [0, 2, 4]  # updates done: 0 (start), then step + 1
    assert list(line.get_ydata()) == pytest.approx([0.45, 0.55, 0.85])


def test_report_adds_the_eval_section_only_with_a_start(eval_runs, tmp_path):
    runs, start = eval_runs
    kw = dict(title="t", config_diff=[], arm_overrides={"none": "-"}, command="c", elapsed_s=1.0)
    _, printed = report.write_report(tmp_path / "a", runs, **kw)
    assert "Held-out eval" not in (tmp_path / "a" / "report.md").read_text() and "eval plot" not in printed
    assert not (tmp_path / "a" / "eval.png").exists()
    _, printed = report.write_report(tmp_path / "b", runs, eval_start=start, **kw)
    assert "## Held-out eval" in (tmp_path / "b" / "report.md").read_text() and "40.0 ± 10.0" in printed


# --- the starting model's eval ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def maths_cfg(tmp_path_factory) -> C.Config:
    """A maths run on a tiny maths organism (40 warm-up steps, ~2 s): it writes numbers, so eval/format is
    not 0 and an eval that differs shows."""
    from projected_grpo.organism import maths
    from projected_grpo.organism.build import OrganismConfig

    spec = maths.MathsOrganismConfig(
        model=OrganismConfig(vocab_size=300, word_boundaries=False, hidden=16, layers=1, heads=2,
                             max_positions=256, mix=(0.5, 0.3, 0.2), per_problem=1, holdout_per_mode=0,
                             steps=40, batch_size=8, lr=1e-2), n_warmup=20, n_train=20)
    path = maths.build_maths_organism(spec, cache_dir=tmp_path_factory.mktemp("organism"), log=None)
    return C.replace(presets.SMOKE, model={"source": "hf", "path": str(path)},
                     env={"name": "maths", "problems": "arithmetic", "eval_size": 6, "max_problems": 8,
                          "warmup_levels": (1,), "train_levels": (2,)},
                     rollout={"mix": 0.0, "max_new_tokens": 8}, run={"steps": 1, "eval_every": 1})


def test_start_eval_is_the_loops_eval_before_any_update(maths_cfg, tmp_path, monkeypatch):
    from projected_grpo.run import train

    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    got = start_eval.start_eval(maths_cfg)
    assert set(got) == {"eval/accuracy", "eval/hack", "eval/format"}
    # one step at a learning rate too small to move a float32 weight: the loop's eval at step 0 sees the
    # starting model, through the merged-knob path (W + tiny == W), and must agree
    cfg = C.replace(maths_cfg, optim={"lr": 1e-30}, run={"dir": str(tmp_path / "r")})
    train.train(cfg)
    (row,) = metrics.read_rows(tmp_path / "r" / metrics.METRICS_FILE)
    assert {k: row[k] for k in got} == got
    assert got["eval/format"] > 0  # the tiny organism writes numbers: a value that can disagree


def test_start_evals_are_cached_per_seed_and_config(maths_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / report.EVAL_START_FILE
    first = start_eval.start_evals(maths_cfg, [0], path)
    saved = json.loads(path.read_text())
    saved["by_seed"]["0"]["eval/accuracy"] = 0.123  # a value only the cache can return
    path.write_text(json.dumps(saved))
    both = start_eval.start_evals(maths_cfg, [0, 1], path)
    assert both[0]["eval/accuracy"] == 0.123 and set(both) == {0, 1} and set(first[0]) == set(both[1])
    other = C.replace(maths_cfg, env={"eval_size": 5})  # another eval set: nothing reused
    assert start_eval.start_evals(other, [0], path)[0]["eval/accuracy"] != 0.123


# --- demo --task math --------------------------------------------------------------------------------------

def test_demo_tasks():
    assert experiment.DEMO_TASKS["code"][1]["quick"] == experiment.DEMO_ARMS
    preset, arms = experiment.DEMO_TASKS["math"]
    assert preset in presets.PRESETS and arms == {"quick": ("none",), "all": ("none",)}


@pytest.mark.slow
def test_math_demo_end_to_end_on_a_tiny_organism(maths_cfg, tmp_path, monkeypatch, capsys):
    # the math demo's sweep with a tiny organism in place of the real one (seconds, not minutes)
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(presets.PRESETS, "math-demo", C.replace(maths_cfg, run={"steps": 2}))
    out = tmp_path / "demo"
    assert experiment.demo_main(["--task", "math", "--seeds", "2", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Held-out eval" in md and "projected-grpo demo --task math" in md
    assert (out / "eval.png").stat().st_size > 0 and (out / report.EVAL_START_FILE).is_file()
    assert "eval plot" in capsys.readouterr().out
