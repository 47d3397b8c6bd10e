"""`projected-grpo separation` (run/separation.py), Tier 0 of docs/findings.md section 8: on the smoke model
end to end (fast), the direction scores it reports are the direction monitor's own, and on SmolLM2-135M-
Instruct a small slice end to end (slow; skips without `projected-grpo get-model smollm2`). The statistics:
tests/test_check.py (ordering), test_monitors.py (auc_interval), test_stats.py (cluster_bootstrap).

Run: pytest tests/test_separation.py (-m slow for the SmolLM2 test)
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from projected_grpo.cli import main
from projected_grpo.hack import check, monitors
from projected_grpo.hack.direction import ExtractSettings, extract, extract_direction
from projected_grpo.hack.pairs import builtin_pairs, completions_by_prompt, encode_pair
from projected_grpo.run import separation


def _numbers(x) -> list[float]:
    """Every number in a JSON-able record (None skipped), bools left out."""
    if isinstance(x, dict):
        return [v for y in x.values() for v in _numbers(y)]
    if isinstance(x, list):
        return [v for y in x for v in _numbers(y)]
    return [float(x)] if isinstance(x, int | float) and not isinstance(x, bool) else []


def _check_result(result: dict, printed: str) -> None:
    """Every control ran and was compared in both measures, and every number is finite."""
    chk, order = result["check"], result["direction"]
    assert not chk["unavailable"]
    assert set(chk["vs"]) == set(check.CHECKED) and set(order["vs"]) == set(check.CHECKED)
    assert set(order["auc"]) == {"real", *check.CHECKED} and set(result["scores"]) == set(order["auc"])
    assert all(math.isfinite(v) for v in _numbers({k: result[k] for k in ("check", "direction", "probe")}))
    assert all(math.isfinite(v) for s in result["scores"].values() for v in s)
    for name in check.CHECKED:
        assert f"| {name} |" in printed
    assert "nan" not in printed and "inf" not in printed and "probe monitor (layer" in printed


def test_smoke_end_to_end_deterministic(tmp_path, capsys):
    argv = ["separation", "--preset", "smoke", "--env.max-problems", "12", "--proj.pairs-per-problem", "3",
            "--monitor.probe-problems", "8", "--n-boot", "200"]
    results = []
    for run in ("a", "b"):
        assert main([*argv, "--out", str(tmp_path / run)]) == 0
        printed = capsys.readouterr().out
        result = json.loads((tmp_path / run / separation.JSON_FILE).read_text())
        _check_result(result, printed)
        assert (tmp_path / run / separation.MD_FILE).read_text() == printed.rpartition("\nwall:")[0] + "\n"
        results.append(result)
    # 12 problems, 3 pairs each: round(0.25 * 12) = 3 prompts held out, up to 3 hacks and 3 cleans each
    r = results[0]
    assert (r["check"]["n_prompts"], r["check"]["n_pairs"], r["direction"]["n_prompts"]) == (3, 9, 3)
    assert 12 <= r["direction"]["n_completions"] == len(r["labels"]) <= 18
    # 8 probe problems: 2 held out, each with its hack, clean and buggy templates
    assert results[0]["probe"]["prompts_heldout"] == 2
    for r in results:
        r.pop("wall_s"), r["setup"].pop("argv")  # the argv differs in --out
    assert results[0] == results[1]  # deterministic given the seed


def test_refuses_a_control_flag_and_no_heldout_prompt(capsys):
    assert main(["separation", "--preset", "smoke", "--proj.control", "random"]) == 2
    assert "set by the command itself" in capsys.readouterr().err
    assert main(["separation", "--preset", "smoke", "--env.max-problems", "6",
                 "--proj.heldout-frac", "0"]) == 2
    assert "holds no prompt out" in capsys.readouterr().err
    assert main(["separation", "--preset", "smoke", "--chunk-tokens", "0"]) == 2
    assert "--chunk-tokens 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from projected_grpo.envs.coding.env import CodeEnv
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.knobs.adapters import wrap
    from projected_grpo.organism.build import smoke_model_and_tokenizer

    model, tok = smoke_model_and_tokenizer()
    knobs = wrap(model, kind="svd", cache_dir=tmp_path_factory.mktemp("svd"))
    return model, knobs, tok, builtin_pairs(CodeEnv(BUILTIN_PROBLEMS), BUILTIN_PROBLEMS[:8], per_problem=3)


def test_extract_keeps_what_extract_direction_computed(smoke):
    model, knobs, tok, pairs = smoke
    s = ExtractSettings(k=3, heldout_frac=0.25, nll_norm="mean", nll_const=None, control="none", seed=0)
    ext = extract(model, knobs, tok, pairs, s)
    d = extract_direction(model, knobs, tok, pairs, s)
    assert ext.direction.meta == d.meta and all(torch.equal(ext.real[n], d.V[n]) for n in d.V)
    assert set(ext.controls) == set(check.CHECKED)
    # the check in the stats is the separation of the held-out gradients it keeps, under the V's it keeps
    g_hack, g_clean = ext.g_held
    D = {m: g_hack[m] - g_clean[m] for m in g_hack}
    assert len(ext.held) == 6 and all(g.shape[0] == 6 for g in g_hack.values())
    by_prompt = {p: i for i, p in enumerate(dict.fromkeys(str(p.prompt) for p in ext.held))}
    groups = [by_prompt[str(p.prompt)] for p in ext.held]
    again = check.separation(D, groups, ext.real, ext.controls)
    assert again["scores"].keys() == d.stats["check"]["scores"].keys()
    for name, iv in again["scores"].items():
        assert iv == pytest.approx(d.stats["check"]["scores"][name]), name


def test_heldout_scores_are_the_direction_monitors_raw_scores(smoke):
    # the direction monitor scores a completion by its own NLL gradient along V: computed afresh by the
    # monitor for each held-out completion, it equals what separation reads off the extraction's gradients
    model, knobs, tok, pairs = smoke
    s = ExtractSettings(k=3, heldout_frac=0.25, nll_norm="mean", nll_const=None, control="none", seed=0)
    ext = extract(model, knobs, tok, pairs, s)
    scores, labels, groups = separation.heldout_scores(ext)
    rows = [(ext.held[i], side) for group in completions_by_prompt(ext.held) for i, side in group]
    ids = [encode_pair(tok, p) for p, _ in rows]
    prompts = [p for p, _, _ in ids]
    completions = [h if side == "hack" else c for (_, h, c), (_, side) in zip(ids, rows)]
    for name, V in {"real": ext.real, "energy": ext.controls["energy"]}.items():
        mon = monitors.Direction(model, knobs, V, [], tok.pad_token_id, "mean", 1.0, {})
        torch.testing.assert_close(mon.raw(prompts, completions), scores[name], rtol=1e-4, atol=1e-6)
    assert labels.tolist() == [side == "hack" for _, side in rows] and len(set(groups)) == 2


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_small_slice_end_to_end(smollm2_dir, smollm2_cache, tmp_path, monkeypatch, capsys):
    # SmolLM2 on arithmetic under the contains verifier (no data files needed): 8 problems x 3 pairs, 2
    # prompts held out; 4 probe problems
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(smollm2_cache))
    out = tmp_path / "tier0"
    assert main(["separation", "--preset", "smollm2-cpu", "--model", str(smollm2_dir), "--env.name", "maths",
                 "--env.modes", "contains", "--env.max-problems", "8", "--proj.pairs-per-problem", "3",
                 "--monitor.probe-problems", "4", "--n-boot", "200", "--chunk-tokens", "1024",  # 5 GB, not 12
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / separation.JSON_FILE).read_text())
    _check_result(result, printed)
    assert result["check"]["n_prompts"] == 2 and result["probe"]["prompts_heldout"] == 1
    print(printed)
