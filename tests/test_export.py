"""run/export.py: a trained run's checkpoint out as a plain Hugging Face directory, loaded by stock
transformers, gives the knob model's deployed logits (quarantine zeroed); bad inputs fail in one line.

One 2-step `route` smoke run (quarantine written) is shared by the fast tests; the organism export
(its build takes ~2.5 min) is slow. Run: pytest -q tests/test_export.py
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.cli import main
from projected_grpo.envs.coding.env import load_problems
from projected_grpo.envs.coding.prompts import build_messages
from projected_grpo.errors import UserError
from projected_grpo.run import checkpoint, setup
from projected_grpo.run import export as E
from projected_grpo.run import train as T
from projected_grpo.sampling.pack import prompt_text_and_ids

# fp32 logits of the exported model vs the knob model (W + ΔW merged once vs the side path each forward):
# the same function summed in two orders, so each is off the float64 truth by some e and they differ by
# up to 2e. Measured (e, diff): smoke model (|logits| < 1) 2.0e-7, 1.8e-7; organism (|logits| up to 23)
# 8.9e-6, 1.3e-5; SmolLM2 after 3 steps (|logits| up to 41, 30 layers) 1.3e-4, 8.5e-5.
ATOL = 1e-5


def route_cfg(root: pathlib.Path, name: str, **model) -> C.Config:
    """Smoke preset, arm route, 2 steps, a checkpoint per step, 8 new tokens: seconds on a CPU."""
    return C.replace(presets.SMOKE, env={"max_problems": 6}, rollout={"max_new_tokens": 8},
                     proj={"arm": "route"}, model={"cache_dir": str(root / "cache"), **model},
                     run={"steps": 2, "checkpoint_every": 1, "dir": str(root / name)})


@pytest.fixture(scope="module")
def route_run(tmp_path_factory) -> tuple[pathlib.Path, C.Config]:
    root = tmp_path_factory.mktemp("export")
    cfg = route_cfg(root, "route")
    T.train(cfg)
    return pathlib.Path(cfg.run.dir), cfg


def knob_model(cfg: C.Config, ckpt: pathlib.Path):
    """The run's knob model with both knobs of `ckpt` loaded, as training had them."""
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    checkpoint.load_checkpoint(ckpt).load_knobs(knobs)
    return model, tok, knobs


def prompt_batch(tok, cfg: C.Config) -> torch.Tensor:
    """Two chat-formatted problem prompts, cut to a common length (1, T) -> (2, T)."""
    ids = [prompt_text_and_ids(tok, build_messages(p))[1] for p in load_problems(max_problems=2)]
    n = min(len(i) for i in ids)
    return torch.tensor([i[:n] for i in ids])


def check_round_trip(run_dir: pathlib.Path, cfg: C.Config, out: pathlib.Path, step: int | None = None):
    """Export, load with stock classes, check its logits equal the knob model's with the quarantine
    ablated (within ATOL + twice the knob model's own fp32 error); returns the max |diff| to that, the
    quarantine-on and the base (knobs zeroed) model's logits, for the caller to check the knobs matter."""
    assert E.export_run(run_dir, out, step=step) == out
    ckpt = E.pick_checkpoint(run_dir, step)
    model, tok, knobs = knob_model(cfg, ckpt)
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    stock_tok = AutoTokenizer.from_pretrained(out)
    x = prompt_batch(tok, cfg)
    assert torch.equal(prompt_batch(stock_tok, cfg), x)  # the saved tokenizer encodes as the run's did
    assert stock_tok.chat_template == tok.chat_template
    with torch.no_grad():
        got = stock(x).logits
        with knobs.ablate_quarantine():
            deployed = model(x).logits
        trained = model(x).logits  # quarantine on: what training sampled
        with knobs.zeroed():
            base = model(x).logits
        e = float((deployed.double() - deployed_in_float64(model, knobs, x)).abs().max())
    diff = float((got - deployed).abs().max())
    assert diff <= ATOL + 2 * e, f"export vs knob model: max |diff| {diff:.3g}, fp32 error {e:.3g}"
    return [diff] + [float((got - ref).abs().max()) for ref in (trained, base)]


def deployed_in_float64(model, knobs, x: torch.Tensor) -> torch.Tensor:
    """The knob model's deployed logits in float64 (the reference both fp32 paths round away from).
    Leaves `model` in float64: call it last."""
    model.double()
    with knobs.ablate_quarantine():
        return model(x).logits


def test_round_trip_gives_the_deployed_logits(route_run, tmp_path):
    run_dir, cfg = route_run
    ckpt = checkpoint.latest_checkpoint(run_dir)
    hack = load_knob_state(ckpt, ".delta_hack")
    assert any(bool(t.any()) for t in hack.values()), "route wrote no quarantine: the test would be vacuous"
    d_deployed, d_trained, d_base = check_round_trip(run_dir, cfg, tmp_path / "out")
    assert d_deployed <= ATOL  # the smoke model's logits are small: within 1e-5 outright
    assert d_trained > 10 * ATOL  # the quarantine changes the logits, and the export leaves it out
    assert d_base > 10 * ATOL  # the main knob moved: the export is not just the base model
    record = json.loads((tmp_path / "out" / E.EXPORT_FILE).read_text())
    assert record["checkpoint"] == ckpt.name and record["arm"] == "route" and record["quarantine"] == "zeroed"


def test_exported_weights_are_W_plus_the_main_delta(route_run, tmp_path):
    """Per wrapped Linear: W_exp = W + U·diag(δS)·Vh of the main knob alone (float64 reference, fp32
    rounding); every other tensor (embeddings, norms) is the base model's, bit for bit."""
    run_dir, cfg = route_run
    E.export_run(run_dir, tmp_path / "out")
    model, _, knobs = knob_model(cfg, checkpoint.latest_checkpoint(run_dir))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for n, m in knobs.modules.items():
        want = m.base.weight.double() + (m.U.double() * m.delta.double()) @ m.Vh.double()
        got = exported[f"{n}.weight"].double()
        assert (got - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max(), n
        hack = (m.U.double() * m.delta_hack.double()) @ m.Vh.double()
        assert (got - want - hack).abs().max() > 1e3 * torch.finfo(torch.float32).eps * want.abs().max() \
            or not m.delta_hack.any(), n  # where the quarantine is non-zero, W_exp is not W + ΔW + ΔW_hack
    wrapped = {f"{n}.weight" for n in knobs.modules}
    base = {k.replace(".base.", "."): v for k, v in model.state_dict().items()}
    for k, v in exported.items():
        if k not in wrapped:
            assert torch.equal(v, base[k]), k


def load_knob_state(ckpt: pathlib.Path, suffix: str) -> dict[str, torch.Tensor]:
    """Knobs.save's tensors `<module>.delta` / `<module>.delta_hack` of a checkpoint ending in `suffix`."""
    state, _ = store.load_tensors(ckpt / "knobs.safetensors")
    return {k: v for k, v in state.items() if k.endswith(suffix)}


def test_step_picks_that_checkpoint(route_run, tmp_path):
    run_dir, cfg = route_run
    check_round_trip(run_dir, cfg, tmp_path / "s1", step=1)
    E.export_run(run_dir, tmp_path / "s2", step=2)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "s1").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "s2").state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # step 2's knob differs from step 1's


def test_cli_prints_the_directory_last(route_run, tmp_path, capsys):
    run_dir, _ = route_run
    out = tmp_path / "cli"
    assert E.export_main([str(run_dir), str(out), "--step", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_refusals_are_one_line_user_errors(route_run, tmp_path, capsys):
    run_dir, _ = route_run
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        E.export_run(run_dir, full)
    assert (full / "x").read_text() == "keep me"
    empty_run = tmp_path / "no-ckpt"
    empty_run.mkdir()
    with pytest.raises(UserError, match="no ckpt-\\* checkpoint"):
        E.export_run(empty_run, tmp_path / "o1")
    with pytest.raises(UserError, match="no checkpoint for step 7; there are steps 1, 2"):
        E.export_run(run_dir, tmp_path / "o2", step=7)
    assert main(["export", str(run_dir), str(tmp_path / "o3"), "--step", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step 7" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_checkpoint_of_another_model_is_refused(route_run, tmp_path):
    run_dir, cfg = route_run
    other = tmp_path / "other"
    ckpt = checkpoint.latest_checkpoint(run_dir)
    (other / ckpt.name).mkdir(parents=True)
    for f in checkpoint.FILES:
        (other / ckpt.name / f).write_bytes((ckpt / f).read_bytes())
    state, meta = store.load_tensors(ckpt / "knobs.safetensors")
    # knobs saved for another base model (Knobs.save records the model's fingerprint): refused by name
    store.save_tensors(other / ckpt.name / "knobs.safetensors", state, meta | {"fingerprint": "0" * 16})
    with pytest.raises(UserError, match=r"knobs.safetensors was saved for kind='svd' fingerprint='0{16}'"):
        E.export_run(other, tmp_path / "o")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the organism build alone is ~9 min on one core (3200 warm-up steps)
def test_organism_run_exports(tmp_path):
    """The embedded organism (its own tokenizer and cached build, tied embeddings) exports too."""
    cfg = route_cfg(tmp_path, "organism", source="organism")
    T.train(C.replace(cfg, run={"steps": 1}))
    _, _, d_base = check_round_trip(pathlib.Path(cfg.run.dir), cfg, tmp_path / "out")
    assert d_base > 10 * ATOL
