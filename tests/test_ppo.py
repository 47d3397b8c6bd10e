"""PPO (run/ppo.py, knobs/value_head.py): the value head's masking, GAE from the episode reward, epochs > 1
(the ratio moves, the clip bites, the loss falls on a fixed batch), a smoke run that is finite and resumes
exactly, and `projected-grpo train --loss.algo ppo` reaching it. Whitening and explained variance by hand.

Run: .venv/bin/pytest -q tests/test_ppo.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.cli import main as cli_main
from projected_grpo.knobs.value_head import ValueHead
from projected_grpo.objective.losses import explained_variance, whiten
from projected_grpo.run import metrics, ppo, setup
from projected_grpo.sampling.pack import pack
from projected_grpo.sampling.sample import sample_and_grade
from projected_grpo.store import load_tensors

TIME_KEYS = ("time/generate", "time/grade", "time/backward", "time/step")


def small(root: pathlib.Path, name: str, **sections) -> C.Config:
    """The smoke preset under PPO, cut down: 6 problems, 8 new tokens, 4 steps, a checkpoint every 2."""
    cfg = C.replace(presets.SMOKE, env={"max_problems": 6}, rollout={"max_new_tokens": 8},
                    loss={"algo": "ppo"}, model={"cache_dir": str(root / "cache")},
                    run={"steps": 4, "checkpoint_every": 2, "dir": str(root / name)})
    return C.replace(cfg, **sections)


# --- pure pieces ------------------------------------------------------------------------------------

def test_whiten_hand_example():
    # masked tokens 1, 2, 3 (the 100 is padding): mean 2, Bessel var (1 + 0 + 1) / 2 = 1 -> -1, 0, 1
    x, m = torch.tensor([[1.0, 2.0], [3.0, 100.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w, stats = whiten(x, m, eps=0.0)
    assert w.tolist() == [[-1.0, 0.0], [1.0, 0.0]] and stats["adv/raw_std"].item() == 1.0


def test_explained_variance_hand_example():
    # R = [1, 2, 3] (mean 2, population var 2/3); V = [1, 2, 2]: R - V = [0, 0, 1], mean 1/3,
    # var (1/9 + 1/9 + 4/9) / 3 = 2/9 -> 1 - (2/9) / (2/3) = 2/3; padding (V 50, R -50) ignored
    R, V = torch.tensor([[1.0, 2.0, 3.0, -50.0]]), torch.tensor([[1.0, 2.0, 2.0, 50.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(V, R, m).item() == pytest.approx(2 / 3)
    assert explained_variance(R, R, m).item() == 1.0  # a perfect critic
    assert math.isnan(explained_variance(V, torch.ones(1, 4), m).item())  # returns without variance


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=3, max_size=12), st.floats(0.1, 10), st.floats(-3, 3))
def test_whiten_is_affine_invariant(xs, scale, shift):
    x = torch.tensor([xs])
    if float(x.std()) * min(1.0, scale) < 1e-2:  # whiten's eps (1e-8 on the variance) would show at 1e-3
        return
    m = torch.ones_like(x)
    torch.testing.assert_close(whiten(x, m)[0], whiten(scale * x + shift, m)[0], rtol=1e-3, atol=1e-3)


# --- the value head's masking ---------------------------------------------------------------------------

def test_value_head_is_linear_on_real_tokens_zero_on_padding_and_never_reaches_the_hidden_state():
    head = ValueHead(3)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
        head.bias.fill_(0.5)
    hidden = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [9.0, 9.0, 9.0]]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    v = head(hidden, mask)
    assert v.tolist() == [[1.5, 2.5, 0.0]]  # w·h + b: 1 + .5, 2 + .5; the padded position reads 0, not 27.5
    v.sum().backward()
    assert hidden.grad is None  # detached: the value loss never moves the knobs
    # d(sum V)/dw = sum of the real tokens' h = [1, 1, 0]: the padded h = [9, 9, 9] adds nothing
    assert head.weight.grad.tolist() == [1.0, 1.0, 0.0] and head.bias.grad.item() == 2.0
    with pytest.raises(ValueError, match=r"hidden must be \(N, T, H=3\)"):
        head(hidden[..., :2], mask)


def test_values_of_a_sequence_do_not_depend_on_its_batch_padding(tmp_path):
    cfg = small(tmp_path, "r")
    model, tok = setup.load_model(cfg)
    head = ValueHead(model.config.hidden_size)
    with torch.no_grad():
        head.weight.copy_(torch.linspace(-1, 1, model.config.hidden_size))
        short = pack([[5, 6, 7]], [[8, 9]], tok.pad_token_id)
        both = pack([[5, 6, 7], [4, 5, 6, 7, 8]], [[8, 9], [10, 11, 12, 13]], tok.pad_token_id)
        _, _, v1 = ppo.forward_with_values(model, head, short, temperature=1.0)
        logp, ent, v2 = ppo.forward_with_values(model, head, both, temperature=1.0)
    torch.testing.assert_close(v2[0, :2], v1[0], rtol=1e-5, atol=1e-6)
    assert v2[0, 2:].abs().sum() == 0 and logp[0, 2:].abs().sum() == 0 and ent[0, 2:].abs().sum() == 0
    assert v2[1].ne(0).all()  # every real token of the long row has a value


def test_gae_reads_the_episode_reward_on_the_last_real_token():
    cfg = C.replace(presets.SMOKE, ppo={"whiten": False, "gamma": 1.0, "lam": 1.0})
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    zeros = torch.zeros(2, 3)
    old = ppo.Scored(mask=mask, logp_old=zeros, values_old=torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]),
                     logp_ref=zeros, logp_b=zeros, is_student=torch.ones(2, dtype=bool))
    adv, returns, stats = ppo.advantages(cfg, torch.tensor([1.0, 2.0]), old)
    # row 0 (2 tokens, R = 1 on token 1): gamma = lam = 1 -> A_t = R - V_t = [.5, .5], padding 0
    # row 1 (3 tokens, R = 2 on token 2, V = 0): A = [2, 2, 2]; returns = A + V = R on every real token
    assert adv.tolist() == [[0.5, 0.5, 0.0], [2.0, 2.0, 2.0]]
    assert returns.tolist() == [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]
    assert "value/explained_var" in stats


# --- epochs > 1 on a fixed batch ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory):
    """The smoke model on 2 arithmetic problems x 4 samples, with a fixed reward signal (the random smoke
    model earns none by itself)."""
    root = tmp_path_factory.mktemp("ppo_batch")
    cfg = small(root, "r", env={"name": "maths", "problems": "arithmetic", "max_problems": 4},
                rollout={"prompts_per_step": 2, "mix": 0.0, "max_new_tokens": 8},
                ppo={"epochs": 6, "minibatches": 1, "ent_coef": 0.0, "lr": 0.05},
                optim={"min_lr_frac": 1.0})
    model, tok = setup.load_model(cfg)
    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = env.problem_sets()["train"][:2]
        ids = {i: p for i, (_, p) in setup.prompt_table(env, tok, problems).items()}
        with torch.no_grad():
            samples = sample_and_grade(model, tok, env, problems, ids, 4, max_new_tokens=8, seed=0)
    return cfg, samples, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])


def test_epochs_move_the_ratio_the_clip_bites_and_the_loss_falls(fixed_batch):
    cfg, samples, rewards = fixed_batch
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    head = ValueHead(model.config.hidden_size)
    opt = ppo.make_optimizer(cfg, knobs, head)
    updates, old, adv, _ = ppo.optimize(cfg, model, knobs, head, opt, tok, samples, rewards, {}, step=0)
    assert len(updates) == 6  # 6 epochs x 1 minibatch, each over the whole batch
    first, last = updates[0], updates[-1]
    # the first update sees the policy that scored the batch: ratio 1 (to rounding), nothing clipped
    assert first["clip/region_frac"] == 0.0 and first["ppo/approx_kl"] < 1e-8
    assert abs(first["ratio/mean"] - 1.0) < 1e-5
    # later epochs: the ratio has moved off 1 and the clip is active on some tokens
    assert max(u["clip/region_frac"] for u in updates[1:]) > 0.0 and last["ppo/approx_kl"] > 1e-4
    # the same batch each time: the surrogate and the value loss fall
    assert last["loss/policy"] < first["loss/policy"] and last["loss/value"] < first["loss/value"]
    assert all(math.isfinite(v) for u in updates for v in u.values())


def test_teacher_rows_keep_the_scoring_policy_as_logp_old_so_their_ratio_moves_too(fixed_batch):
    cfg, samples, rewards = fixed_batch
    teachers = [dataclasses.replace(s, student=(i % 4 != 3)) for i, s in enumerate(samples)]  # 1 in 4
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    head = ValueHead(model.config.hidden_size)
    updates, *_ = ppo.optimize(cfg, model, knobs, head, ppo.make_optimizer(cfg, knobs, head), tok, teachers,
                               rewards, {}, step=0)
    ratios = [u["teacher/ratio_mean"] for u in updates]
    # imitation recomputes logp_old on the current policy; across epochs it stays the scoring policy's, so
    # the teacher rows' ratio starts at 1 and then moves (and the clip can bound them, as it does students)
    assert abs(ratios[0] - 1.0) < 1e-5 and max(abs(r - 1.0) for r in ratios[1:]) > 1e-3
    assert all(u["teacher/is_weight_mean"] == 1.0 for u in updates)


def test_minibatches_split_the_batch_and_one_epoch_of_one_minibatch_is_on_policy(fixed_batch):
    cfg, samples, rewards = fixed_batch
    cfg = C.replace(cfg, ppo={"epochs": 1, "minibatches": 3})
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    head = ValueHead(model.config.hidden_size)
    updates, *_ = ppo.optimize(cfg, model, knobs, head, ppo.make_optimizer(cfg, knobs, head), tok, samples,
                               rewards, {}, step=0)
    assert len(updates) == 3 and updates[0]["clip/region_frac"] == 0.0
    assert all(u["grad/norm"] > 0 for u in updates)


# --- end to end: finite, resumes exactly, reached from the CLI ------------------------------------------

def _rows(run_dir: pathlib.Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in metrics.read_rows(run_dir /
                                                                                           "metrics.jsonl")]


@pytest.mark.bitwise  # a promise across a save and a load: docs/reproducibility.md
def test_smoke_ppo_run_is_finite_and_a_stop_at_a_checkpoint_resumes_exactly(tmp_path):
    cfg = small(tmp_path, "full")
    summary = ppo.train_ppo(cfg)
    full = pathlib.Path(cfg.run.dir)
    rows = metrics.read_rows(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and summary["algo"] == "ppo"
    for r in rows:
        assert set(metrics.REQUIRED_METRICS) <= set(r) and metrics.undocumented(r) == []
        assert all(math.isfinite(v) for v in r.values() if not isinstance(v, str))
    assert rows[-1]["knob/norm"] > 0 and all(r["groups/skipped"] == 0.0 for r in rows)
    # stopped at the step-2 checkpoint: the run directory as it was then (later checkpoint and summary
    # gone; its later rows are dropped by the resume), resumed in a fresh model, knobs, head and optimizer
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "ckpt-000004")
    (cut / "summary.json").unlink()
    ppo.train_ppo(C.replace(cfg, run={"dir": str(cut), "resume": True}))
    assert _rows(cut) == _rows(full)
    for name in ("knobs.safetensors", "extra.safetensors"):  # knobs and value head, bit for bit
        a, b = load_tensors(full / "ckpt-000004" / name)[0], load_tensors(cut / "ckpt-000004" / name)[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    head = load_tensors(full / "ckpt-000004" / "extra.safetensors")[0]
    assert set(head) == {"value_head.weight", "value_head.bias"} and head["value_head.weight"].abs().sum() > 0


def test_cli_train_with_loss_algo_ppo_reaches_the_ppo_loop(tmp_path):
    run_dir = tmp_path / "cli"
    assert cli_main(["train", "--preset", "smoke", "--loss.algo", "ppo", "--run-dir", str(run_dir),
                     "--model.cache-dir", str(tmp_path / "cache"), "--env.max-problems", "6",
                     "--rollout.max-new-tokens", "8", "--run.steps", "1", "--ppo.epochs", "2"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algo"] == "ppo" and (run_dir / "ckpt-000001" / "extra.safetensors").is_file()
