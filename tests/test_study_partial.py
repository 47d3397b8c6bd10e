"""study --report-only's cut of a study in progress (preregistered.finished_only): an arm keeps only its
finished runs (summary.json written), an arm with none is dropped and named as missing, and a part without
a finished `none` and one other arm is left out (nothing to compare yet)."""

from __future__ import annotations

from projected_grpo.study.preregistered import finished_only


def _runs(tmp_path, part, arm, n, done):
    dirs = []
    for s in range(n):
        d = tmp_path / part / f"{arm}-s{s}"
        d.mkdir(parents=True)
        if s < done:
            (d / "summary.json").write_text("{}")
        dirs.append(d)
    return dirs


def test_finished_only_keeps_finished_runs_and_names_the_missing(tmp_path):
    main = {"none": _runs(tmp_path, "main", "none", 3, 3), "erase": _runs(tmp_path, "main", "erase", 3, 2),
            "route": _runs(tmp_path, "main", "route", 3, 0)}
    fold = {"none": _runs(tmp_path, "fold", "none", 2, 0), "erase": _runs(tmp_path, "fold", "erase", 2, 2)}
    bench = {"none": main["none"], "inoculation": _runs(tmp_path, "bench", "inoculation", 3, 3)}
    planned = [("main", [], main, ["a note"]), ("fold", [], fold, []), ("bench", [], bench, [])]
    out = finished_only(planned)
    assert [p for p, *_ in out] == ["main", "bench"]  # the fold has no finished `none`
    _, _, dirs, notes = out[0]
    assert dirs == {"none": main["none"], "erase": main["erase"][:2]}  # route: nothing finished
    assert notes[0].startswith("PARTIAL: written with `--report-only` while runs were still missing: "
                               "erase (missing 1 of 3), route (missing 3 of 3);") and notes[1] == "a note"
    assert out[1][3] == ["every planned run has finished"]
