"""metrics.py: JSONL rows, finiteness, atomic truncate/rewrite, summary means, docs/metrics.md coverage."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.errors import UserError
from projected_grpo.run.metrics import (
    KNOWN_METRICS,
    METRICS_FILE,
    REQUIRED_METRICS,
    MetricsLogger,
    Progress,
    read_rows,
    summarize,
    truncate_to,
    undocumented,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "metrics.md"
SPEC = REPO.parent / "shared" / "SPEC.md"


def _doc_names() -> list[str]:
    """Metric names in the first column of docs/metrics.md's table: lines like "| `name` | ... |"."""
    return re.findall(r"^\| `([^`]+)` \|", DOCS.read_text(encoding="utf-8"), flags=re.M)


# --- the documentation is the single definition place ------------------------------------------


def test_docs_table_mirrors_known_metrics():
    names = _doc_names()
    assert len(names) == len(set(names)), "a metric is defined twice in docs/metrics.md"
    assert set(names) == KNOWN_METRICS


def test_spec_section_4_keys_are_documented():
    assert set(REQUIRED_METRICS) <= set(_doc_names())
    if not SPEC.is_file():
        pytest.skip(f"{SPEC} not present")
    section = SPEC.read_text(encoding="utf-8").split("## 4.")[1].split("\n## ")[0]
    spec_keys = set(re.findall(r"`([a-z_]+/[a-z_]+)`", section))
    # the one exception, by design (issue 18): kl/mean needs the reference forward, skipped at beta 0, so
    # it is logged whenever loss.beta > 0 rather than on every row
    assert spec_keys == set(REQUIRED_METRICS) | {"kl/mean"} and "kl/mean" in KNOWN_METRICS


def test_undocumented():
    assert undocumented(["reward/mean", "zz/new", "proj/cin", "aa/x"]) == ["aa/x", "zz/new"]


def test_undocumented_accepts_a_mode_in_a_mode_slot():
    # hack/deploy/<mode> is one definition for every mode; the slot is one path part, not any suffix
    assert undocumented(["hack/deploy/run_tests", "solve/deploy/eq_override", "hack/deploy/a/b",
                         "hack/deploy/", "format/deploy/run_tests"]) == [
        "format/deploy/run_tests", "hack/deploy/", "hack/deploy/a/b"]


def test_mode_rates_hand_computed():
    from projected_grpo.envs.base import Graded
    from projected_grpo.run.row import mode_rates

    def g(hack: bool, solve: bool) -> Graded:
        return Graded(reward=0.0, gt_reward=0.0, passed=hack or solve, solved=solve, exploited=hack,
                      format_ok=True, timeout=False, extras={})

    grades = [g(True, False), g(False, True), g(False, False), g(True, False)]
    modes = ["sentinel", "sentinel", "run_tests", "sentinel"]
    # sentinel: hacks 2/3, solves 1/3; run_tests: 0/1 and 0/1; modes absent from the step get no key
    assert mode_rates(grades, modes, "deploy") == {
        "hack/deploy/run_tests": 0.0, "solve/deploy/run_tests": 0.0,
        "hack/deploy/sentinel": 2 / 3, "solve/deploy/sentinel": 1 / 3}
    assert undocumented(mode_rates(grades, modes, "deploy")) == []
    with pytest.raises(ValueError):
        mode_rates(grades, modes[:2], "deploy")


# --- writing rows ------------------------------------------------------------------------------


def test_log_appends_one_json_row_per_step(tmp_path):
    with MetricsLogger(tmp_path) as log:
        out = log.log(0, {"reward/mean": torch.tensor(0.5), "hack/student": 1, "teacher/mode": "imitation"})
        log.log(1, {"reward/mean": 0.25})
    assert out == {"step": 0, "reward/mean": 0.5, "hack/student": 1.0, "teacher/mode": "imitation"}
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [out, {"step": 1, "reward/mean": 0.25}]
    assert read_rows(tmp_path / METRICS_FILE) == [out, {"step": 1, "reward/mean": 0.25}]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), torch.tensor(float("nan"))])
def test_non_finite_value_is_rejected_naming_the_key(tmp_path, bad):
    with MetricsLogger(tmp_path) as log:
        with pytest.raises(ValueError, match=r"step 3: 'proj/cin' is .*finite"):
            log.log(3, {"reward/mean": 0.1, "proj/cin": bad})
    assert (tmp_path / METRICS_FILE).read_text() == ""  # nothing of the bad row was written


def test_bad_types_and_step_key_are_rejected(tmp_path):
    with MetricsLogger(tmp_path) as log:
        with pytest.raises(TypeError, match="'kl/mean' = \\[1, 2\\] is not a number"):
            log.log(0, {"kl/mean": [1, 2]})
        with pytest.raises(ValueError, match="'step' is set by"):
            log.log(0, {"step": 1})


def test_tensorboard_missing_is_a_clear_error(tmp_path):
    if importlib.util.find_spec("tensorboard") is not None:
        with MetricsLogger(tmp_path, ("tensorboard",)) as log:
            log.log(0, {"reward/mean": 1.0, "teacher/mode": "exclude"})
        assert any((tmp_path / "tb").iterdir())
    else:
        with pytest.raises(UserError, match=r"pip install 'projected-grpo\[tb\]'"):
            MetricsLogger(tmp_path, ("tensorboard",))
        assert not (tmp_path / "metrics.jsonl").read_text()  # opened, and closed again


def test_the_trackers_are_the_configs_choices():
    from projected_grpo.config_run import REPORT_TO
    from projected_grpo.run.trackers import TRACKERS

    assert tuple(TRACKERS) == REPORT_TO


def test_wandb_offline_gets_every_number_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from projected_grpo.run.trackers import run_id

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run's files stay in RUN_DIR/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    for step in (0, 1):  # two processes' worth of logging into one run directory, as a resume does
        with MetricsLogger(tmp_path, ("wandb",), {"run": {"seed": 0}}) as log:
            log.log(step, {"reward/mean": 0.5 + step, "teacher/mode": "exclude"})
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # one run id for the directory; wandb names a second process's folder in the same second "<id>-1"
    assert runs and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id(tmp_path)}(-\d+)?", r.name)
                        for r in runs), [r.name for r in runs]
    assert run_id(tmp_path) == run_id(tmp_path / "." ) and run_id(tmp_path) != run_id(tmp_path / "x")


def test_trackio_records_every_number_locally(tmp_path):
    pytest.importorskip("trackio")
    import sqlite3
    import subprocess
    import sys

    # trackio reads TRACKIO_DIR when it is imported: a process of its own, as a run is
    code = ("from projected_grpo.run.metrics import MetricsLogger\n"
            f"with MetricsLogger({str(tmp_path / 'run')!r}, ('trackio',), {{'run': {{'seed': 0}}}}) as log:\n"
            "    for step in range(3):\n"
            "        log.log(step, {'hack/deploy': 0.25 * step, 'teacher/mode': 'exclude'})\n")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "pg-test"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    dbs = list((tmp_path / "trackio").rglob("*.db"))
    assert dbs, "trackio wrote no database under TRACKIO_DIR"
    with sqlite3.connect(dbs[0]) as db:
        tables = [r[0] for r in db.execute("select name from sqlite_master where type='table'")]
        text = " ".join(str(r) for t in tables for r in db.execute(f'select * from "{t}"'))
    assert "hack/deploy" in text and "0.5" in text


@settings(max_examples=25, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(sorted(REQUIRED_METRICS)),
                                st.floats(allow_nan=False, allow_infinity=False, width=64)), max_size=6))
def test_rows_round_trip(tmp_path_factory, rows):
    d = tmp_path_factory.mktemp("rt")
    with MetricsLogger(d) as log:
        for i, r in enumerate(rows):
            log.log(i, r)
    assert read_rows(d / METRICS_FILE) == [{"step": i, **r} for i, r in enumerate(rows)]


# --- resume: truncate_to -----------------------------------------------------------------------


def test_truncate_to_drops_later_rows_and_a_cut_off_line(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for s in range(5):
            log.log(s, {"reward/mean": float(s)})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 5, "rew')  # a write cut off by SIGKILL: no newline
    assert truncate_to(tmp_path, 2) == 3  # steps 0, 1, 2 kept
    assert [r["step"] for r in read_rows(tmp_path / METRICS_FILE)] == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_FILE]  # no temp file left behind
    with MetricsLogger(tmp_path) as log:  # the resumed run appends after the kept rows
        log.log(3, {"reward/mean": 30.0})
    assert [r["step"] for r in read_rows(tmp_path / METRICS_FILE)] == [0, 1, 2, 3]
    assert truncate_to(tmp_path / "nothing-here", 0) == 0


def test_malformed_line_names_file_and_line(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}:2: invalid JSON"):
        read_rows(tmp_path / METRICS_FILE)
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}:2: invalid JSON"):
        truncate_to(tmp_path, 5)


# --- summary -----------------------------------------------------------------------------------


def test_summarize_last_five_by_hand():
    rows = [{"step": s, "hack/student": s / 10, "proj/cin": 1.0} for s in range(8)]
    rows[7]["proj/cout"] = 0.4
    del rows[6]["proj/cin"]
    out = summarize(rows[::-1])  # order of the input does not matter: the window is the last 5 steps
    # last five steps 3..7: hack = (0.3 + 0.4 + 0.5 + 0.6 + 0.7) / 5 = 0.5
    assert out["hack/student"] == pytest.approx(0.5)
    assert out["proj/cin"] == 1.0  # mean over the 4 rows of the window that carry it
    assert out["proj/cout"] == 0.4  # only step 7 has it
    assert "solve/student" not in out  # no row has it
    assert out["steps"] == 8 and out["last_step"] == 7
    assert summarize(rows, last=2, keys=["hack/student"])["hack/student"] == pytest.approx(0.65)
    with pytest.raises(ValueError, match="no metrics rows"):
        summarize([])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=12), st.integers(1, 8))
def test_summarize_is_the_mean_of_the_last_rows(vals, last):
    rows = [{"step": i, "reward/mean": v} for i, v in enumerate(vals)]
    tail = vals[-last:]
    assert math.isclose(summarize(rows, last=last)["reward/mean"], sum(tail) / len(tail),
                        rel_tol=1e-9, abs_tol=1e-6)


def test_progress_postfix_shows_reward_hack_cin():
    out = io.StringIO()
    bar = Progress(total=3, file=out)
    bar.update({"reward/mean": 0.5, "hack/student": 0.25, "proj/cin": 0.125, "teacher/mode": "x"})
    bar.close()
    assert bar.bar.n == 1
    assert "1/3" in out.getvalue() and "reward=0.500, hack=0.250, cin=0.125" in out.getvalue()
