"""DPO (run/dpo.py): the reference is the base model (knobs zeroed), the fit/held-out split and the batch
order, a smoke run that raises its margin and resumes exactly, and dpo.before / model.init_knobs (the
`dpo_then_grpo` arm: V_hack still extracted at zero knobs).

Run: .venv/bin/pytest -q tests/test_dpo.py
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import shutil

import pytest
import torch

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.errors import UserError
from projected_grpo.hack import resolve
from projected_grpo.hack.pairs import Pair, encode_pair
from projected_grpo.organism.build import smoke_model_and_tokenizer
from projected_grpo.run import dpo, metrics, setup
from projected_grpo.run import train as T
from projected_grpo.store import load_tensors

TIME_KEYS = ("time/step",)


def small(root: pathlib.Path, name: str, **sections) -> C.Config:
    """The smoke preset for DPO: 6 steps of 4 pairs, a checkpoint every 2 steps, 2 samples per problem."""
    cfg = C.replace(presets.SMOKE, rollout={"max_new_tokens": 8}, model={"cache_dir": str(root / "cache")},
                    dpo={"steps": 6, "batch_pairs": 4, "lr": 0.05, "sample_n": 2},
                    run={"checkpoint_every": 2, "dir": str(root / name)})
    return C.replace(cfg, **sections)


def _items(cfg: C.Config, tok) -> list:
    with contextlib.closing(setup.make_env(cfg)) as env:
        pair_list = resolve.v_pairs(cfg, env, env.problem_sets()["train"])
    out = []
    for p in pair_list[:4]:
        prompt, hack, clean = encode_pair(tok, p)
        out.append((prompt, clean, hack))
    return out


def test_reference_log_probs_are_the_base_model_s_under_zeroed_knobs(tmp_path):
    cfg = small(tmp_path, "r")
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    items = _items(cfg, tok)
    with torch.no_grad():
        for v in knobs.values("main").values():
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(1)))
    ref = dpo.reference_logps(model, knobs, tok, items, "cpu", chunk=4)
    ref3 = dpo.reference_logps(model, knobs, tok, items, "cpu", chunk=3)
    base, _ = smoke_model_and_tokenizer(seed=cfg.run.seed)  # the same weights with no knob at all
    with torch.no_grad():
        plain = dpo.seq_logps(base, tok, items, "cpu", chunk=4)
        policy = dpo.seq_logps(model, tok, items, "cpu", chunk=4)
    for side in (0, 1):  # chosen, rejected: exactly the base model's, and not the knobbed policy's
        # zeroed knobs are the base model bit for bit at the same batch shapes (docs/reproducibility.md);
        # another chunking is another batch composition: equal only to float rounding on some CPUs
        assert torch.equal(ref[side], plain[side])
        torch.testing.assert_close(ref3[side], plain[side], rtol=1e-5, atol=1e-5)
        assert (ref[side] - policy[side]).abs().min() > 1e-3
    assert ref[0].shape == (4,) and all(float(x) < 0 for x in ref[0])  # summed log-probs of real tokens


def test_split_holds_out_whole_prompts_by_a_stable_hash():
    pairs = [Pair(f"prompt {i // 2}", f"hack {i}", f"clean {i}") for i in range(8)]  # 4 prompts x 2 pairs
    fit, held = dpo.split_pairs(pairs, 0.25)
    assert sorted(fit + held) == list(range(8)) and len(held) == 2  # round(.25 * 4) = 1 prompt, 2 pairs
    assert len({pairs[i].prompt for i in held}) == 1 and {pairs[i].prompt for i in fit}.isdisjoint(
        {pairs[i].prompt for i in held})
    assert dpo.split_pairs(list(reversed(pairs)), 0.25)[1] != [] and dpo.split_pairs(pairs, 0.0) == (
        list(range(8)), [])
    assert {pairs[i].prompt for i in dpo.split_pairs(pairs, 0.25)[1]} == {pairs[i].prompt for i in held}
    with pytest.raises(UserError, match="too few"):
        dpo.split_pairs(pairs[:2], 0.5)  # one prompt: nothing left to fit


def test_batches_walk_a_fresh_permutation_each_epoch():
    steps = [dpo.batch_indices(s, 6, 3, seed=0) for s in range(4)]  # 2 batches per epoch of 6 pairs
    assert sorted(steps[0] + steps[1]) == list(range(6)) and sorted(steps[2] + steps[3]) == list(range(6))
    assert steps[0] + steps[1] != steps[2] + steps[3]  # another order in epoch 1
    assert dpo.batch_indices(2, 6, 3, seed=0) == steps[2]  # a function of the step alone (resume)


def _rows(run_dir: pathlib.Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIME_KEYS}
            for r in metrics.read_rows(run_dir / "metrics.jsonl")]


@pytest.mark.bitwise  # a promise across a save and a load: docs/reproducibility.md
def test_smoke_dpo_raises_the_margin_is_finite_and_resumes_exactly(tmp_path):
    cfg = small(tmp_path, "full")
    summary = dpo.train_dpo(cfg)
    full = pathlib.Path(cfg.run.dir)
    rows = metrics.read_rows(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        assert metrics.undocumented(r) == [] and all(math.isfinite(v) for v in r.values())
    # knobs start at zero (policy = reference): step 0's loss (before its update) is log 2 at margin 0
    # exactly; then the fit margin rises and the loss falls
    assert rows[0]["dpo/margin"] == 0.0 and rows[0]["loss/dpo"] == pytest.approx(math.log(2))
    assert rows[-1]["dpo/margin"] > 0 and rows[-1]["loss/dpo"] < math.log(2)
    assert summary["dpo/heldout_margin"] == rows[-1]["dpo/heldout_margin"] and summary["n_heldout"] > 0
    assert {"dpo/hack_before", "dpo/solve_before"} <= set(rows[0]) and "dpo/hack_after" in rows[-1]
    final = load_tensors(full / setup.KNOBS_FILE)[0]
    last = load_tensors(full / "ckpt-000006" / "knobs.safetensors")[0]
    assert all(torch.equal(final[k], last[k]) for k in final)
    # stopped at the step-4 checkpoint, then resumed: the same rows and knobs
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "ckpt-000006")
    for name in ("summary.json", setup.KNOBS_FILE):
        (cut / name).unlink()
    dpo.train_dpo(C.replace(cfg, run={"dir": str(cut), "resume": True}))
    assert _rows(cut) == _rows(full)
    again = load_tensors(cut / setup.KNOBS_FILE)[0]
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_dpo_before_runs_the_pass_once_and_grpo_starts_from_its_knobs(tmp_path, monkeypatch):
    cfg = small(tmp_path, "both", dpo={"steps": 2, "before": True, "sample_n": 0}, run={"steps": 1})
    starts = []
    real = setup.wrap_knobs

    def spy(c, model):  # the knob values each loop starts from
        knobs = real(c, model)
        starts.append((c.dpo.before, {n: v.clone() for n, v in knobs.values("main").items()}))
        return knobs

    monkeypatch.setattr(setup, "wrap_knobs", spy)
    assert T.main(["--config", _write(tmp_path, cfg)]) == 0
    run_dir = pathlib.Path(cfg.run.dir)
    assert (run_dir / "dpo" / "summary.json").is_file() and (run_dir / "summary.json").is_file()
    dpo_knobs = load_tensors(run_dir / "dpo" / setup.KNOBS_FILE)[0]
    (sub_before, sub_start), (grpo_before, grpo_start) = starts
    assert not sub_before and all(float(v.abs().max()) == 0 for v in sub_start.values())  # DPO from zero
    assert grpo_before and all(torch.equal(grpo_start[n], dpo_knobs[f"{n}.delta"]) for n in grpo_start)
    # one V_hack file: the GRPO loop, starting from non-zero knobs, still extracts (or loads) at zero
    assert len(list((tmp_path / "cache" / "v_hack").iterdir())) == 1
    sub_cfg = json.loads((run_dir / "dpo" / "config.json").read_text())
    assert sub_cfg["dpo"]["before"] is False and sub_cfg["run"]["dir"] == str(run_dir / "dpo")
    dpo.pass_before(cfg)  # finished: skipped, not retrained
    assert len(starts) == 2


def _write(root: pathlib.Path, cfg: C.Config) -> str:
    path = root / "plan.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


def test_start_knobs_need_a_run_dir_and_exclude_init_knobs(tmp_path):
    with pytest.raises(UserError, match="pass --run-dir"):
        setup.start_knobs(C.replace(presets.SMOKE, dpo={"before": True}))
    with pytest.raises(UserError, match="set one of them"):
        C.replace(presets.SMOKE, dpo={"before": True}, model={"init_knobs": "k.safetensors"})
    cfg = small(tmp_path, "r")
    model, _ = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    for v in knobs.values("main").values():
        v.fill_(0.5)
    knobs.save(tmp_path / "k.safetensors")
    with resolve.at_zero(knobs):
        assert all(float(v.abs().max()) == 0 for v in knobs.values("main").values())
    assert all(float(v.min()) == 0.5 for v in knobs.values("main").values())  # restored
    model2, _ = setup.load_model(cfg)
    started = setup.wrap_knobs(C.replace(cfg, model={"init_knobs": str(tmp_path / "k.safetensors")}), model2)
    assert all(float(v.min()) == 0.5 for v in started.values("main").values())
