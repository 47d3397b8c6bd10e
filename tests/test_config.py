"""Config: every field documented and read, Literal checks, presets, derived sizes, CLI parsing.

Run: .venv/bin/pytest -q tests/test_config.py
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import pathlib
import re
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from projected_grpo import config as C
from projected_grpo import presets as P
from projected_grpo.errors import UserError


def parse_args(argv):
    return P.parse(argv, "projected-grpo train")[0]

SRC = pathlib.Path(C.__file__).parent
SECTIONS = [f for f in dataclasses.fields(C.Config)]


def _section_classes():
    hints = typing.get_type_hints(C.Config)
    return {f.name: hints[f.name] for f in SECTIONS}


def test_every_field_has_a_docstring_line():
    trees = [ast.parse((SRC / name).read_text())
             for name in ("config.py", "config_algos.py", "config_monitor.py")]
    missing = []
    for cls in (n for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                if not (doc and isinstance(nxt.value.value, str)):
                    missing.append(f"{cls.name}.{node.target.id}")
    assert missing == []


def _source_outside_config() -> str:
    schema = ("config.py", "config_algos.py")
    return "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name not in schema)


def unread_fields(code: str) -> list[str]:
    """Config fields that `code` never reads as `cfg.<section>.<field>` (the project's one way to read a
    setting: a bare `.device` or `model.device` could be any object's). A derived property read as
    `cfg.<section>.<property>` counts as reading the fields its body uses (`self.<field>`)."""
    unread = []
    for name, cls in _section_classes().items():
        via_props = set()
        for prop, v in vars(cls).items():
            if isinstance(v, property) and re.search(rf"\bcfg\.{name}\.{prop}\b", code):
                via_props |= set(re.findall(r"self\.(\w+)", inspect.getsource(v.fget)))
        for f in dataclasses.fields(cls):
            if f.name not in via_props and not re.search(rf"\bcfg\.{name}\.{f.name}\b", code):
                unread.append(f"{name}.{f.name}")
    return unread


def test_every_field_is_read_outside_config():
    # A field nobody reads is a silently ignored knob (NeMo's normalize_rewards, STYLE §10.6).
    assert unread_fields(_source_outside_config()) == []


def test_the_field_read_check_catches_a_removed_read():
    # issue 13: removing every read of model.device used to pass, because `.device` matched `mask.device`
    code = re.sub(r"\bcfg\.model\.device\b", "cfg.model.elsewhere", _source_outside_config())
    assert "mask.device" in code and unread_fields(code) == ["model.device"]
    # mix is read only through the derived G_t / G_s: with neither read, mix is unread
    code = re.sub(r"\bcfg\.rollout\.G_[st]\b", "cfg.rollout.xx", _source_outside_config())
    assert unread_fields(code) == ["rollout.mix"]


def test_literal_fields_reject_bad_values_naming_field_and_choices():
    for cls in _section_classes().values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if typing.get_origin(hints[f.name]) is typing.Literal:
                with pytest.raises(ValueError) as e:
                    cls(**{f.name: "no-such-choice"})
                msg = str(e.value)
                assert f"{cls.__name__}.{f.name}" in msg and "\n" not in msg
                for choice in typing.get_args(hints[f.name]):
                    assert repr(choice) in msg


@pytest.mark.parametrize("section, kw, field", [
    ("RolloutCfg", {"mix": 1.0}, "mix"),
    ("RolloutCfg", {"prompts_per_step": 4, "micro_prompts": 3}, "prompts_per_step"),
    ("RolloutCfg", {"group_size": 2, "mix": 0.9}, "mix"),  # round(1.8) = 2 teacher rows: no student left
    ("OptimCfg", {"betas": (0.9, 1.0)}, "betas"),
    ("LossCfg", {"beta": -1.0}, "beta"),
    ("ProjCfg", {"purge_moments": True, "gate": "reverse"}, "purge_moments"),
])
def test_range_checks(section, kw, field):
    with pytest.raises(ValueError, match=f"{section}.{field}"):
        getattr(C, section)(**kw)


def test_presets_carry_the_original_study_settings():
    fast, full = P.PRESETS["fast"], P.PRESETS["full"]
    assert (fast.run.steps, fast.rollout.group_size, fast.rollout.prompts_per_step) == (60, 8, 4)
    assert (fast.rollout.max_new_tokens, fast.optim.lr, fast.optim.betas) == (512, 3e-3, (0.5, 0.9))
    assert fast.rollout.mix == 0.125
    assert (full.run.steps, full.rollout.group_size, full.rollout.prompts_per_step) == (200, 6, 43)
    assert (full.rollout.max_new_tokens, full.optim.lr, full.loss.beta) == (1024, 1e-3, 1e-3)
    # as the seed has them (issue 14): mix 0.5 and AdamW's betas in `full`, clip 10 and a cosine to 0 in both
    assert (full.rollout.mix, full.optim.betas) == (0.5, (0.9, 0.99))
    assert all((c.optim.clip_norm, c.optim.min_lr_frac) == (10.0, 0.0) for c in (fast, full))
    assert P.PRESETS["smoke"].model.source == "smoke" and P.PRESETS["demo"].model.source == "organism"


def test_derived_sizes():
    r = C.RolloutCfg(prompts_per_step=4, group_size=8, mix=0.125, max_new_tokens=512, micro_prompts=2)
    # G_t = round(8 * 0.125) = 1, G_s = 8 - 1 = 7; 4 prompts / 2 per micro-batch = 2 micro-batches
    # Dr.GRPO denominator = G * max_new_tokens * prompts = 8 * 512 * 4 = 16384
    assert (r.G_t, r.G_s, r.micro, r.n_micro, r.dr_grpo_denom) == (1, 7, 2, 2, 16384)


@given(G=st.integers(2, 64), mix=st.floats(0.0, 0.999))
def test_group_split_property(G, mix):
    try:
        r = C.RolloutCfg(group_size=G, mix=mix)
    except ValueError as e:
        assert "no student" in str(e)
        return
    assert r.G_s + r.G_t == G and r.G_s >= 1 and r.G_t >= 0


def test_dict_and_json_round_trip(tmp_path):
    cfg = C.replace(P.PRESETS["full"], model={"path": "/m"}, run={"seed": 3})
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg.to_dict()))
    assert C.Config.from_json(str(p)) == cfg


def test_unknown_key_in_config_file_is_named(tmp_path):
    d = P.SMOKE.to_dict()
    d["loss"]["betta"] = 1.0
    with pytest.raises(ValueError, match=r"loss\.betta"):
        C.Config.from_dict(d, where="x.json")


@pytest.mark.parametrize("old, report_to", [(True, ("tensorboard",)), (False, ())])
def test_an_earlier_versions_run_tensorboard_reads_as_report_to(old, report_to):
    """A run directory written before run.report_to existed (run.tensorboard: bool) still loads, meaning the
    same; a dict with both fields is not an old one and fails as before."""
    d = P.SMOKE.to_dict()
    del d["run"]["report_to"]
    d["run"]["tensorboard"] = old
    cfg = C.Config.from_dict(d, where="old/config.json")
    assert cfg.run.report_to == report_to and cfg == C.replace(P.SMOKE, run={"report_to": report_to})
    assert "tensorboard" in d["run"]  # the caller's dict is not changed
    d["run"]["report_to"] = []
    with pytest.raises(ValueError, match=r"run\.tensorboard"):
        C.Config.from_dict(d, where="x.json")


@pytest.mark.parametrize("text, message", [
    ('{"run": {"steps": 2,}}', r"c\.json: not valid JSON: Expecting property name"),
    ('[1, 2]', r"c\.json: expected a JSON object of sections, got list"),
    ('{"run": {"steps": "two"}}', r"c\.json: run\.steps: expected int, got 'two'"),
    ('{"run": {"steps": 2.5}}', r"run\.steps: expected int, got 2\.5"),
    ('{"optim": {"lr": "0.1"}}', r"optim\.lr: expected float, got '0\.1'"),
    ('{"optim": {"betas": [0.9]}}', r"optim\.betas: expected tuple\[float, float\], got \(0\.9,\)"),
    ('{"run": {"report_to": ["wandb", "comet"]}}', r"report_to=\('wandb', 'comet'\): \['comet'\]"),
    ('{"loss": {"zero_var": "nope"}}', r"loss\.zero_var: expected one of 'skip', 'resample', got 'nope'"),
    ('{"run": {"steps": -1}}', r"c\.json: .*steps=-1 must be > 0"),
])
def test_config_file_errors_name_the_file_and_field(tmp_path, text, message):
    p = tmp_path / "c.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):
        C.Config.from_json(str(p))


def test_config_file_takes_json_numbers_as_floats(tmp_path):
    p = tmp_path / "c.json"  # JSON writes 1.0 as 1: an int is a valid float
    p.write_text('{"rollout": {"temperature": 1}, "optim": {"lr": 1}}')
    cfg = C.Config.from_json(str(p))
    assert cfg.rollout.temperature == 1 and cfg.optim.lr == 1


def test_hf_only_model_fields_are_refused_for_built_in_models():
    with pytest.raises(ValueError, match=r"model.path, model.dtype: read only when model.source='hf'"):
        C.replace(P.DEMO, model={"path": "/m", "dtype": "bfloat16"})
    assert C.replace(P.DEMO, model={"source": "hf", "path": "/m", "dtype": "bfloat16"}).model.path == "/m"


def test_cli_shorthands_overrides_and_config_file(tmp_path):
    cfg = parse_args(["--preset", "fast", "--arm", "route", "--model", "/models/q", "--run-dir", "r1",
                      "--resume", "--rollout.group-size", "6", "--loss.teacher", "exclude"])
    assert (cfg.proj.arm, cfg.model.source, cfg.model.path, cfg.run.dir, cfg.run.resume) == \
        ("route", "hf", "/models/q", "r1", True)
    assert (cfg.rollout.group_size, cfg.loss.teacher, cfg.run.steps) == (6, "exclude", 60)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(C.replace(P.SMOKE, run={"steps": 7}).to_dict()))
    assert parse_args(["--config", str(p), "--arm", "erase"]).run.steps == 7


def test_cli_bad_values_fail_with_one_line(capsys):
    with pytest.raises(UserError, match=r"ProjCfg\.arm='bogus' is not one of \['none', 'erase', 'route', "
                                        r"'erase_bounded'\]"):
        parse_args(["--arm", "bogus"])
    with pytest.raises(UserError, match="--preset 'nope' is not one of"):
        parse_args(["--preset", "nope"])
    with pytest.raises(UserError, match="set by the command itself"):
        P.parse(["--run.seed", "3"], "x", forbid=("--run.seed",))


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for name, cls in _section_classes().items():
        for f in dataclasses.fields(cls):
            assert f"--{name}.{f.name.replace('_', '-')}" in out, f"{name}.{f.name} missing from --help"
