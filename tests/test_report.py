"""The report: verdict lines per arm (the rules themselves: test_verdicts.py), the curves plot, report.md."""

from __future__ import annotations

import pytest
from test_experiment import write_run  # a hand-made run directory

from projected_grpo.study import arms, report
from projected_grpo.study.report import Stat

# --- verdict lines (rules: tests/test_verdicts.py) -------------------------------------------------

def _agg(**arms: tuple[float, float]) -> dict[str, dict[str, Stat]]:
    return {a: {"hack/deploy": Stat(h, None, 1), "solve/deploy": Stat(s, None, 1),
                "format/deploy": Stat(0.8, None, 1)} for a, (h, s) in arms.items()}


def test_verdict_words_per_arm_controls_get_none():
    agg = _agg(none=(0.6, 0.4), erase=(0.25, 0.32), route=(0.35, 0.4), nonhack_V=(0.1, 0.2),
               gt_reward=(0.05, 0.6))
    v = report.verdicts(agg)
    assert set(v) == {"erase", "route", "nonhack_V"}  # none and gt_reward are controls
    assert v["erase"].word == "support" and v["erase"].hack_drop == pytest.approx(0.35)
    assert v["route"].word == "inconclusive"  # 25 pts down: between 15 and 30
    assert v["nonhack_V"].word == "falsified"  # 50 pts down but solve -20 pts
    lines = report.verdict_lines(agg)
    assert lines[0].startswith("erase: SUPPORT (preregistered H1: hack -35.0 pts, solve -8.0 pts)")
    assert lines[1].startswith("route: INCONCLUSIVE")
    assert "SEM undefined" in lines[-1]


def test_verdict_lines_show_ours_and_real_vs_random(tmp_path):
    runs = {"none": [write_run(tmp_path / f"n{i}", [0.6] * 6, [0.3] * 6) for i in range(2)],
            "gt_reward": [write_run(tmp_path / f"g{i}", [0.0] * 6, [0.5 + i / 10] * 6) for i in range(2)],
            "erase": [write_run(tmp_path / f"e{i}", [0.2 + i / 10] * 6, [0.35] * 6) for i in range(2)],
            "random_V": [write_run(tmp_path / f"r{i}", [0.55] * 6, [0.3] * 6) for i in range(2)]}
    agg, start = report.aggregate(runs), report.aggregate(runs, "start")
    lines = report.verdict_lines(agg, start)
    text = "\n".join(lines)
    # erase: hack 0.25 +- 0.05 vs none 0.6 (35 down), solve +5: support; vs gt_reward 0.55: -20 pts
    # gt_reward's solve is flat (start = end): the positive control failed, and the report says so first
    assert lines[0].startswith("positive control gt_reward: FAILED (solve +0.0 pts from its start (0.550 -> "
                               "0.550), target +15): honest training does not raise solving")
    assert lines[1] == "erase: SUPPORT (preregistered H1: hack -35.0 pts, solve +5.0 pts)"
    assert "ours: capability lost (vs gt_reward: solve -20.0 pts" in text
    assert "ours: real V beats random V: hack -30.0 pts vs random_V (combined SEM 5.0 pts)" in text
    assert "goal (H1 support, solve within 10 pts of gt_reward, beats random V): not met: solve -20.0" in text
    assert "random_V: FALSIFIED" in text  # 5 pts down


def test_verdict_lines_say_whether_the_real_v_beats_the_shuffled_v(tmp_path):
    # demo organism, findings 7.5: erase 0.023 vs shuffled_V 0.046 hack. By hand: erase hack 0.25 +- 0.05,
    # shuffled_V 0.30 +- 0.05: 5 pts apart, combined SEM sqrt(5^2 + 5^2) = 7.1 pts: does NOT beat; random_V
    # 0.55 +- 0: 30 pts apart, SEM 5.0: beats
    runs = {"none": [write_run(tmp_path / f"n{i}", [0.6] * 6, [0.3] * 6) for i in range(2)],
            "erase": [write_run(tmp_path / f"e{i}", [0.2 + i / 10] * 6, [0.35] * 6) for i in range(2)],
            "random_V": [write_run(tmp_path / f"r{i}", [0.55] * 6, [0.3] * 6) for i in range(2)],
            "shuffled_V": [write_run(tmp_path / f"s{i}", [0.25 + i / 10] * 6, [0.35] * 6) for i in range(2)]}
    agg, start = report.aggregate(runs), report.aggregate(runs, "start")
    text = "\n".join(report.verdict_lines(agg, start))
    assert "ours: real V beats random V: hack -30.0 pts vs random_V (combined SEM 5.0 pts)" in text
    assert "ours: real V does NOT beat shuffled V: hack -5.0 pts vs shuffled_V (combined SEM 7.1 pts)" in text
    # a named twin: route_update against route_update@shuffled, passed as arms.control_twins gives it

    assert arms.control_twins(["erase", "shuffled_V", "route", "route@shuffled"], "@shuffled") == {
        "erase": "shuffled_V", "route": "route@shuffled"}
    agg2 = {"none": agg["none"], "route": agg["erase"], "route@shuffled": agg["shuffled_V"]}
    start2 = {"none": start["none"], "route": start["erase"], "route@shuffled": start["shuffled_V"]}
    lines = report.verdict_lines(agg2, start2, {}, {"route": "route@shuffled"})
    assert any("real V does NOT beat shuffled V: hack -5.0 pts vs route@shuffled" in ln for ln in lines)
    assert not any("shuffled V" in ln for ln in report.verdict_lines(agg2, start2, {}, {}))  # none asked


def test_verdict_is_on_the_deployed_model(tmp_path):
    # route's students sample with the quarantine knob on: hack 0.6 there, like none's, but 0.2 deployed.
    # H1 reads the deployed rates: 0.6 -> 0.2 = 40 pts down, solve 0.4 -> 0.35 = -5 pts: support
    runs = {"none": [write_run(tmp_path / "n", [0.6] * 5, [0.4] * 5)],
            "route": [write_run(tmp_path / "r", [0.6] * 5, [0.4] * 5, deploy=([0.2] * 5, [0.35] * 5))]}
    agg = report.aggregate(runs)
    assert agg["route"]["hack/student"].mean == pytest.approx(0.6)
    v = report.verdicts(agg)["route"]
    assert v.word == "support" and v.hack_drop == pytest.approx(0.4)
    assert v.solve_change == pytest.approx(-0.05)


def test_a_deployed_model_that_stopped_writing_code_is_flagged(tmp_path):
    # route hacks 0 deployed, but answers well-formed 0.05 of the time vs none's 0.8: flagged (a 0.75 drop
    # > 0.10); erase's 0.75 is within 0.10 of 0.8: not flagged
    runs = {"none": [write_run(tmp_path / "n", [0.6] * 5, [0.05] * 5)],
            "erase": [write_run(tmp_path / "e", [0.2] * 5, [0.05] * 5, fmt=0.75)],
            "route": [write_run(tmp_path / "r", [0.6] * 5, [0.0] * 5, deploy=([0.0] * 5, [0.0] * 5),
                                fmt=0.05)]}
    lines = report.verdict_lines(report.aggregate(runs))
    assert lines[1].startswith("route: SUPPORT")
    notes = [ln for ln in lines if ln.startswith("note:")]
    assert notes == ["note: route's deployed model gives a well-formed answer 0.050 of the time vs 0.800 "
                     "for `none`: its low hack rate may be a broken model rather than a clean one"]


def test_runs_without_deploy_rates_get_no_verdict(tmp_path):
    runs = {"none": [write_run(tmp_path / "n", [0.6] * 5, [0.4] * 5, deploy="none")],
            "erase": [write_run(tmp_path / "e", [0.1] * 5, [0.4] * 5)]}
    agg = report.aggregate(runs)
    assert "no H1 verdict: the runs of ['none'] have no hack/deploy" in report.verdict_lines(agg)[0]
    with pytest.raises(ValueError, match="did not log"):
        report.verdicts(agg)


def test_verdicts_need_the_none_arm():
    agg = _agg(erase=(0.1, 0.4))
    assert report.verdicts(agg) == {}
    assert "no `none` arm" in report.verdict_lines(agg)[0]


# --- plot and report.md ---------------------------------------------------------------------------

def test_plot_has_one_line_per_arm_and_sem_bands_with_two_seeds(tmp_path):
    runs = {"none": [write_run(tmp_path / "n0", [0.1, 0.5, 0.9], [0.3] * 3),
                     write_run(tmp_path / "n1", [0.1, 0.3, 0.7], [0.4] * 3)],
            "erase": [write_run(tmp_path / "e0", [0.1] * 3, [0.3] * 3),
                      write_run(tmp_path / "e1", [0.0] * 3, [0.2] * 3)],
            "route": [write_run(tmp_path / "r0", [0.2] * 3, [0.3] * 3),
                      write_run(tmp_path / "r1", [0.1] * 3, [0.3] * 3)]}
    data = report.curves(runs)
    steps, stats = data["none"]["hack/deploy"]
    assert steps == [0, 1, 2] and [s.mean for s in stats] == pytest.approx([0.1, 0.4, 0.8])
    # trailing rolling mean over 2 steps, per seed, then over seeds: seed 0 0.1, 0.3, 0.7; seed 1 0.1, 0.2,
    # 0.5 -> 0.1, 0.25, 0.6
    rolled = report.curves(runs, roll=2)["none"]["hack/deploy"][1]
    assert [s.mean for s in rolled] == pytest.approx([0.1, 0.25, 0.6])
    path = tmp_path / "curves.png"
    fig = report.plot_curves(report.curves(runs, roll=2), path, "smoke preset", raw=data)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    axes = fig.get_axes()
    assert len(axes) == 3
    for ax, ylabel in zip(axes, ("hack", "solve", "well-formed")):
        # per arm: the faint raw line and the rolling mean
        assert len(ax.get_lines()) == 6 and ylabel in ax.get_ylabel() and ax.get_xlabel() == "optimizer step"
        assert [ln.get_alpha() for ln in ax.get_lines()[:2]] == [0.25, None]
        assert len(ax.collections) == 3  # one ± SEM band per arm
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["none", "erase", "route"]
    assert fig._suptitle.get_text() == "smoke preset"


def test_plot_one_seed_has_no_band(tmp_path):
    runs = {"none": [write_run(tmp_path / "n", [0.1, 0.2], [0.3] * 2)],
            "erase": [write_run(tmp_path / "e", [0.1, 0.1], [0.3] * 2)]}
    fig = report.plot_curves(report.curves(runs), tmp_path / "c.png", "t")
    assert all(len(ax.get_lines()) == 2 and not ax.collections for ax in fig.get_axes())


def test_report_contains_table_verdicts_plot_and_command(tmp_path):
    runs = {"none": [write_run(tmp_path / "none-s0", [0.6] * 6, [0.4] * 6)],
            "erase": [write_run(tmp_path / "erase-s0", [0.2] * 6, [0.35] * 6)]}
    path, printed = report.write_report(tmp_path, runs, title="demo", config_diff=["run.steps: 40 -> 6"],
                                        arm_overrides={"none": "proj.arm=none", "erase": "proj.arm=erase"},
                                        command="projected-grpo demo --out X --seeds 1", elapsed_s=12.3)
    md = path.read_text()
    assert "| arm | seeds | hack/deploy | solve/deploy | format/deploy | hack/student | solve/student |" in md
    assert "| erase | 1 | 0.200 ± n/a | 0.350 ± n/a | 0.800 ± n/a | 0.200 ± n/a | 0.350 ± n/a |" in md
    assert "erase: SUPPORT" in md and "![hack, solve and well-formed rate per step](curves.png)" in md
    assert "projected-grpo demo --out X --seeds 1" in md and "`run.steps: 40 -> 6`" in md
    assert "12 s" in md and "(12 s training)" in md  # 6 steps x 2 s of time/step
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert "| none | 1 | 0.600 ± n/a |" in printed and "erase: SUPPORT" in printed
