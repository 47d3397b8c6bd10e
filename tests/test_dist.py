"""Data-parallel training (run/dist.py): no-ops in one process, sums over two real gloo ranks, the merged
global batch, per-prompt sampling seeds, and (slow) `torchrun --nproc_per_node 2` against one process and
against itself killed with SIGKILL and resumed.
Run: .venv/bin/pytest -q tests/test_dist.py   (the torchrun tests are marked slow)
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn

from projected_grpo.envs.base import Graded
from projected_grpo.errors import UserError
from projected_grpo.knobs import adapters
from projected_grpo.knobs.split import Capture
from projected_grpo.run import dist, metrics
from projected_grpo.run.batches import SEED_SCOPES, Batch, merge
from projected_grpo.sampling.generate import generate, step_seed
from projected_grpo.sampling.sample import Sample

TIME_KEYS = ("time/generate", "time/grade", "time/backward", "time/step")


def tiny_knobs(cache: pathlib.Path) -> adapters.Knobs:
    """Two wrapped Linears (3 -> 2): SVD knobs of R = 2 each, named q_proj and v_proj."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"q_proj": nn.Linear(3, 2), "v_proj": nn.Linear(3, 2)})
    return adapters.wrap(model, "svd", targets=("q_proj", "v_proj"), cache_dir=cache)


# --- one process: every function is a no-op ------------------------------------------------------------

def test_one_process_is_a_no_op(tmp_path):
    assert not dist.active() and dist.world_size() == 1 and dist.rank() == 0 and dist.is_main()
    assert dist.shard(5) == range(5)
    assert dist.all_gather({"a": 1}) == [{"a": 1}] and dist.from_main("x") == "x"
    g = torch.tensor([1.0, 2.0])
    assert dist.sum_over_ranks([g, None], [g, g]) == [g, None]
    stats = {"loss/policy": 0.5}
    assert dist.sum_stats(stats) is stats
    knobs = tiny_knobs(tmp_path)
    split = Capture(torch.tensor([True]))
    assert dist.all_reduce_grads(knobs, split) is split and dist.all_reduce_grads(knobs, None) is None
    with dist.main_first():
        pass
    dist.check_world_size(1, "ckpt")
    with pytest.raises(UserError, match="written by 2 rank\\(s\\), this run has 1.*--nproc_per_node 2"):
        dist.check_world_size(2, "ckpt-000004")


# --- two real gloo ranks (torch.multiprocessing) ------------------------------------------------------------

def _rank_main(rank: int, root: str) -> None:
    """One of two gloo ranks: the sums of hand-set gradients, splits and stats, written to rank<r>.pt."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    knobs = tiny_knobs(pathlib.Path(root) / f"cache{rank}")
    q, v = knobs.modules["q_proj"].delta, knobs.modules["v_proj"].delta
    # case A, both ranks backpropagated: rank 0 reached q_proj only, rank 1 both modules
    if rank == 0:
        q.grad = torch.tensor([1.0, 2.0])
        split = Capture(torch.tensor([True, False]))
        split.g_student = {"q_proj": torch.tensor([1.0, 0.0])}
        split.g_teacher = {"q_proj": torch.tensor([0.0, 2.0])}
    else:
        q.grad, v.grad = torch.tensor([10.0, 20.0]), torch.tensor([3.0, 4.0])
        split = Capture(torch.tensor([True]))
        split.g_student = {"q_proj": torch.tensor([10.0, 0.0]), "v_proj": torch.tensor([3.0, 0.0])}
        split.g_teacher = {"q_proj": torch.tensor([0.0, 20.0]), "v_proj": torch.tensor([0.0, 4.0])}
    a = dist.all_reduce_grads(knobs, split)
    case_a = {"q": q.grad.clone(), "v": v.grad.clone(), "hack": [p.grad for p in knobs.hack_parameters()],
              "g_s": a.g_student, "g_t": a.g_teacher}
    # case B: rank 1 had no group with signal (no backward, no split): the sums are rank 0's alone
    for p in knobs.parameters():
        p.grad = None
    if rank == 0:
        q.grad = torch.tensor([1.0, 2.0])
        split = Capture(torch.tensor([True]))
        split.g_student, split.g_teacher = {"q_proj": torch.tensor([1.0, 2.0])}, {"q_proj": torch.zeros(2)}
    else:
        split = None
    b = dist.all_reduce_grads(knobs, split)
    case_b = {"q": q.grad.clone(), "v": v.grad, "g_s": b.g_student, "g_t": b.g_teacher}
    out = {"a": case_a, "b": case_b, "shard": dist.shard(6), "world": dist.world_size(),
           "stats": dist.sum_stats({"loss/policy": 0.25} if rank == 0 else
                                   {"loss/policy": 0.5, "kl/mean": 1.0}),
           "gather": dist.all_gather(f"rank {rank}"), "main": dist.from_main(rank)}
    torch.save(out, f"{root}/rank{rank}.pt")
    dist.close()


@pytest.mark.slow
def test_sums_over_two_gloo_ranks_are_hand_computed_and_identical(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # q: [1, 2] + [10, 20] = [11, 22]; v: (none on rank 0 = zeros) + [3, 4]; no quarantine grad anywhere
    assert r0["a"]["q"].tolist() == [11.0, 22.0] and r0["a"]["v"].tolist() == [3.0, 4.0]
    assert r0["a"]["hack"] == [None, None]  # AdamW skips a None grad: it must stay None, not become zeros
    assert {n: g.tolist() for n, g in r0["a"]["g_s"].items()} == {"q_proj": [11.0, 0.0], "v_proj": [3.0, 0.0]}
    assert {n: g.tolist() for n, g in r0["a"]["g_t"].items()} == {"q_proj": [0.0, 22.0], "v_proj": [0.0, 4.0]}
    # case B: a rank without a backward contributes nothing, and gets the global split too
    assert r0["b"]["q"].tolist() == [1.0, 2.0] and r0["b"]["v"] is None
    assert {n: g.tolist() for n, g in r1["b"]["g_s"].items()} == {"q_proj": [1.0, 2.0]}
    assert (r0["shard"], r1["shard"]) == (range(0, 3), range(3, 6)) and r0["world"] == 2
    assert r0["stats"] == r1["stats"] == {"loss/policy": 0.75, "kl/mean": 1.0}  # 0.25 + 0.5; 0 + 1.0
    assert r0["gather"] == r1["gather"] == ["rank 0", "rank 1"] and r0["main"] == r1["main"] == 0
    for case in ("a", "b"):  # every rank holds the same bits: the knobs stay in lockstep
        for k in ("q", "g_s", "g_t"):
            x, y = r0[case][k], r1[case][k]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else
                    x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x))


# --- the global batch from the ranks' shares ---------------------------------------------------------------

def _sample(pid: str, reward: float, student: bool, hack: bool) -> Sample:
    g = Graded(reward, reward, passed=hack, solved=False, exploited=hack, format_ok=True)
    completion = torch.tensor([3, 4, 5][: 1 + int(reward)])
    return Sample(pid, "run_tests", torch.tensor([1, 2]), completion, "x", None, False, student, g)


def test_merge_of_rank_batches_is_the_global_batch():
    # rank 0 sampled prompt a (one resampling round), rank 1 prompt b (two rounds, zero variance left)
    ga = [_sample("a", 1.0, True, True), _sample("a", 0.0, False, False)]
    gb = [_sample("b", 2.0, True, False), _sample("b", 2.0, False, False)]
    r0 = Batch(3, "train", ["a"], [ga], torch.tensor([[1.0, 0.0]]), torch.tensor([False]), [ga[0]],
               resampled=1, tries=1, clock={"generate": 0.5, "grade": 0.25}, shard=range(0, 1))
    r1 = Batch(3, "train", ["b"], [gb], torch.tensor([[2.0, 2.0]]), torch.tensor([True]), [gb[0]],
               resampled=2, tries=2, clock={"generate": 0.75}, shard=range(1, 2))
    m = merge([r0, r1], range(1, 2))
    assert m.problem_ids == ["a", "b"] and m.groups == [ga, gb] and m.deploy == [ga[0], gb[0]]
    assert torch.equal(m.rewards, torch.tensor([[1.0, 0.0], [2.0, 2.0]]))
    assert m.keep == [0] and m.keep_mine == []  # rank 1's only group has no signal: it backpropagates nothing
    assert merge([r0, r1], range(0, 1)).keep_mine == [0]
    # resampled adds up (1 + 2), tries and clocks are the slowest rank's (the ranks sample side by side)
    assert (m.resampled, m.tries, m.clock) == (3, 2, {"generate": 0.75, "grade": 0.25})
    alone = Batch(3, "train", ["a"], [ga], r0.rewards, r0.zero, [ga[0]])
    assert merge([alone], None) is alone and alone.keep_mine == alone.keep == [0]  # one process


# --- per-prompt sampling seeds: a prompt's samples ignore its batch -----------------------------------------

def test_seed_scopes_batch_is_the_old_seed_and_prompt_depends_on_the_prompt_only():
    batch, prompt = SEED_SCOPES["batch"], SEED_SCOPES["prompt"]
    assert batch(7, 3, 1, [0, 1]) == step_seed(7, 3, 1)  # unchanged single-process seeds
    assert batch(7, 3, 1, [0, 1], "all-student") == step_seed(7, 3, 1, "all-student")
    # prompt 5's seed is the same whether it is sampled beside prompt 2 (one process) or alone (a rank)
    assert prompt(7, 3, 1, [2, 5])[1] == prompt(7, 3, 1, [5])[0] == step_seed(7, 3, 1, "prompt", 5)
    assert len(set(prompt(7, 3, 1, range(8)))) == 8 and prompt(7, 3, 2, [5]) != prompt(7, 3, 1, [5])


def test_prompt_seeds_make_samples_independent_of_the_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=0, eos_token_id=1)).eval()
    p0, p1 = [3, 5, 6, 4], [7, 8, 9, 4]  # equal lengths: no padding, so the logits match bit for bit
    kw = dict(max_new_tokens=6, temperature=1.0, eos_id=1, pad_id=0)
    both = generate(model, [p0, p1], 3, seed=[11, 22], **kw)
    alone = generate(model, [p1], 3, seed=[22], **kw)
    assert all(map(torch.equal, both.completion_ids[3:], alone.completion_ids))  # rows 3..5: p1's samples
    # another batch composition is another matmul shape: equal log-probs only to float rounding on some
    # CPUs (bitwise on Intel's MKL path, last bits off on AMD's), docs/reproducibility.md
    torch.testing.assert_close(torch.cat(both.logp[3:]), torch.cat(alone.logp), rtol=1e-5, atol=1e-5)
    assert all(map(torch.equal, generate(model, [p1], 3, seed=22, **kw).completion_ids,
                   alone.completion_ids))  # 1 seed, 1 gen
    with pytest.raises(ValueError, match="3 seeds for 2 prompts"):
        generate(model, [p0, p1], 3, seed=[1, 2, 3], **kw)


# --- torchrun --nproc_per_node 2 (slow) ---------------------------------------------------------------------

def _args(run_dir: pathlib.Path, cache: pathlib.Path, *extra: str) -> list[str]:
    return ["-m", "projected_grpo.cli", "train", "--preset", "smoke", "--arm", "route",
            "--run-dir", str(run_dir), "--model.cache-dir", str(cache), "--env.max-problems", "6",
            "--rollout.max-new-tokens", "8",
            "--run.steps", "6", "--run.checkpoint-every", "2", *extra]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def _descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun's workers run in sessions of their own: killing the launcher's
    group would leave them training)."""
    try:
        kids = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in pathlib.Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _kill_all_when(proc: subprocess.Popen, ready: pathlib.Path, delay_s: float) -> None:
    """SIGKILL torchrun and every rank `delay_s` seconds after checkpoint `ready` appears (a lost node)."""
    deadline = time.monotonic() + 300
    while not ready.is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, f"run ended before {ready.name}"
        time.sleep(0.01)
    time.sleep(delay_s)
    ranks = _descendants(proc.pid)  # listed first: once the launcher dies they are re-parented
    for pid in [proc.pid, *ranks]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # a sandbox worker that exited on its own meanwhile
            pass
    proc.wait()


def _differences(a: list[dict], b: list[dict]) -> tuple[float, float]:
    """(max abs, max rel) difference over every numeric non-time metric of two runs' rows; relative only
    where |value| > 1e-4 (proj/cout after erasing is ~1e-7 of rounding: its relative error means nothing)."""
    d_abs = d_rel = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k, v in x.items():
            if k in TIME_KEYS or isinstance(v, str):
                assert k in TIME_KEYS or v == y[k], k
                continue
            d_abs = max(d_abs, abs(v - y[k]))
            if abs(v) > 1e-4:
                d_rel = max(d_rel, abs(v - y[k]) / abs(v))
    return d_abs, d_rel


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process_and_resume_after_sigkill(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cache = tmp_path / "cache"
    run = lambda argv: subprocess.run(argv, env=env, check=True, capture_output=True)
    # torchrun needs no flag (rollout.seed_scope auto resolves to prompt there); one process given it trains
    # the same run
    run([sys.executable, *_args(tmp_path / "single", cache, "--rollout.seed-scope", "prompt")])
    run(_torchrun(*_args(tmp_path / "dp", cache)))
    assert json.loads((tmp_path / "dp" / "config.json").read_text())["rollout"]["seed_scope"] == "prompt"

    # the same global batch and seed: every metric and knob within float tolerance (the ranks sum their
    # gradients in another order than one process's micro-batch accumulation)
    single, dp = (metrics.read_rows(tmp_path / d / "metrics.jsonl") for d in ("single", "dp"))
    assert [r["step"] for r in dp] == list(range(6))
    d_abs, d_rel = _differences(single, dp)
    ka, kb = (load_file(tmp_path / d / "ckpt-000006" / "knobs.safetensors") for d in ("single", "dp"))
    k_abs = max(float((ka[k] - kb[k]).abs().max()) for k in ka)
    print(f"torchrun 2 ranks vs 1 process: metrics max abs {d_abs:.3g}, max rel {d_rel:.3g}; knobs max abs "
          f"{k_abs:.3g} (largest |knob| {max(float(v.abs().max()) for v in ka.values()):.3g})")
    assert d_abs < 1e-5 and d_rel < 1e-5 and k_abs < 1e-6
    # only rank 0 wrote: the same files as the one process's run
    names = lambda d: sorted(p.name for p in (tmp_path / d).iterdir())
    assert names("dp") == names("single")
    assert json.loads((tmp_path / "dp" / "ckpt-000006" / "cursors.json").read_text())["world_size"] == 2

    # killed twice (as a checkpoint lands, then mid-step), resumed: exactly the uninterrupted 2-rank run
    killed = tmp_path / "killed"
    step_s = statistics.median(r["time/step"] for r in dp)  # the kill delays are fractions of a step here
    for i, (ckpt, frac) in enumerate([("ckpt-000002", 0.0), ("ckpt-000004", 0.3)]):
        delay = frac * step_s
        proc = subprocess.Popen(_torchrun(*_args(killed, cache, *(["--resume"] if i else []))), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _kill_all_when(proc, killed / ckpt, delay)
        assert not (killed / "summary.json").exists()
    # another world size is refused in one line, before any work
    one_process = _args(killed, cache, "--resume", "--rollout.seed-scope", "prompt")
    one = subprocess.run([sys.executable, *one_process], env=env, capture_output=True, text=True)
    assert one.returncode == 2 and "written by 2 rank(s), this run has 1" in one.stderr
    run(_torchrun(*_args(killed, cache, "--resume")))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]
    assert strip(metrics.read_rows(killed / "metrics.jsonl")) == strip(dp)
    kk = load_file(killed / "ckpt-000006" / "knobs.safetensors")
    assert all(torch.equal(kb[k], kk[k]) for k in kb)
    assert math.isfinite(json.loads((killed / "summary.json").read_text())["hack/student"])
