"""hack/resolve.py: the cache key holds exactly what the extraction reads; the check at a run's start (loud
when V fails it, refused under proj.require_check, written to the run directory).

Run: pytest tests/test_resolve.py
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.errors import UserError
from projected_grpo.hack import resolve
from projected_grpo.hack.direction import Direction


def _cfg(tmp_path, **sections):
    return C.replace(presets.PRESETS["smoke"], model={"cache_dir": str(tmp_path / "cache")}, **sections)


def test_settings_hold_exactly_what_the_extraction_reads(tmp_path):
    base = _cfg(tmp_path)
    s = resolve.extract_settings(base)
    assert (s.k, s.heldout_frac, s.nll_norm, s.nll_const) == (4, 0.25, "mean", None)
    assert (s.control, s.seed) == ("none", 0)
    # nll_norm "mean" never reads the loss's constant (G * max_new_tokens * prompts): not in the key
    assert resolve.extract_settings(C.replace(base, rollout={"group_size": 8})) == s
    const = C.replace(base, proj={"nll_norm": "constant"})
    assert resolve.extract_settings(const).nll_const == float(const.rollout.dr_grpo_denom)
    assert resolve.extract_settings(C.replace(const, rollout={"group_size": 8})).nll_const == 2 * (
        resolve.extract_settings(const).nll_const)
    # the seed draws only the seeded controls; the real V and the deterministic controls share one V
    for control, seeded in [("none", False), ("random", True), ("shuffled", True), ("energy", True),
                            ("within", False), ("nonhack", False)]:
        s7 = resolve.extract_settings(C.replace(base, proj={"control": control}, run={"seed": 7}))
        assert s7.seed == (7 if seeded else 0), control


@pytest.fixture(scope="module")
def smoke_parts(tmp_path_factory):
    from projected_grpo.run import setup

    cfg = _cfg(tmp_path_factory.mktemp("resolve"))
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    return cfg, model, tok, knobs


def test_a_new_group_size_does_not_re_extract_under_mean(smoke_parts, tmp_path, capsys):
    from projected_grpo.run import setup

    cfg, model, tok, knobs = smoke_parts
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = env.problem_sets()["train"]
        V1, line1 = resolve.resolve_v_hack(C.replace(cfg, run={"dir": str(run_dir)}), model, knobs, tok, env,
                                           problems)
        V2, line2 = resolve.resolve_v_hack(C.replace(cfg, rollout={"group_size": 8}), model, knobs, tok, env,
                                           problems)
        _, line3 = resolve.resolve_v_hack(C.replace(cfg, proj={"nll_norm": "constant"}), model, knobs, tok,
                                          env, problems)
    assert "(miss," in line1 and "(hit," in line2 and "(miss," in line3
    assert all(torch.equal(V1[n], V2[n]) for n in V1)
    written = json.loads((run_dir / resolve.CHECK_FILE).read_text())
    assert written["control"] == "none" and written["check"]["n_pairs"] > 0
    assert "V_hack held-out separation" in capsys.readouterr().err


def _direction(beats: bool | None) -> Direction:
    check = {"n_pairs": 6, "n_prompts": 3, "unavailable": {}, "passed": beats,
             "scores": {"real": [0.5, 0.4, 0.6], "random": [0.2, 0.1, 0.3]},
             "vs": {"random": {"diff": [0.3, 0.1, 0.5], "p": 0.01, "p_holm": 0.01, "beats": beats}}}
    return Direction({}, {}, {"stats": json.dumps({"check": check})})


def test_a_v_that_fails_its_check_is_said_loudly_and_refused_on_request(tmp_path):
    cfg = _cfg(tmp_path)
    text, passed = resolve.check_report(cfg, _direction(True))
    assert passed is True and text.startswith("V_hack beats every control on held-out pairs (random)")
    text, passed = resolve.check_report(cfg, _direction(False))
    assert passed is False
    assert text.startswith("!" * 100 + "\nWARNING: V_hack does NOT beat the random control")
    assert "real V does NOT beat it" in text
    with pytest.raises(UserError, match="proj.require_check: V_hack does NOT beat the random control"):
        resolve.check_report(C.replace(cfg, proj={"require_check": True}), _direction(False))
    # undecided (too few held-out prompts) is said, never refused
    text, passed = resolve.check_report(C.replace(cfg, proj={"require_check": True}), _direction(None))
    assert passed is None and text.startswith("V_hack check undecided")
