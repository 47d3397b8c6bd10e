"""The Python API (api.py): the README's example runs as written (on the embedded organism's directory in
place of SmolLM2, for speed), and the API builds the same config the CLI does.

Run: .venv/bin/pytest -q tests/test_api.py
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

import projected_grpo as pg
from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.errors import UserError

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- api-example -->\n```python\n(.*?)```\n<!-- /api-example -->", text, re.S)
    assert m, "README.md lost its API example block"
    return m.group(1)


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    from projected_grpo.run import setup

    organism = setup.ORGANISMS["coding"](presets.DEMO)  # an HF model directory with a chat template
    code = _readme_example()
    for old, new in (('model="smollm2"', f"model={str(organism)!r}"), ('"steps": 10', '"steps": 2')):
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    reward, run_dir = capsys.readouterr().out.split()[-2:]
    assert 0.0 <= float(reward) <= 1.0
    saved = json.loads((pathlib.Path(run_dir) / "config.json").read_text())
    # the run records its reward function and that it had no teacher pool
    assert saved["env"]["reward_fn"].endswith(":brevity") and saved["rollout"]["mix"] == 0.0
    assert len((pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()) == 2


def test_config_is_the_clis():
    cfg = pg.preset("demo", model="some/dir", proj={"arm": "erase"}, run={"steps": 7})
    cli, _ = presets.parse(["--preset", "demo", "--model", "some/dir", "--arm", "erase", "--run.steps", "7"],
                           "projected-grpo train")
    assert cfg == cli and isinstance(cfg, pg.Config) and set(pg.PRESETS) == set(presets.PRESETS)
    with pytest.raises(UserError, match="is not one of"):
        pg.preset("nope")
    with pytest.raises(UserError, match="together"):
        pg.train(C.replace(presets.SMOKE), reward_fn=lambda **kw: [])
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pg.nope  # noqa: B018


def test_report_names_what_is_missing(tmp_path):
    with pytest.raises(UserError, match="no report"):
        pg.report(tmp_path)
    (tmp_path / "report.md").write_text("# r\n")
    assert pg.report(tmp_path) == "# r\n"
