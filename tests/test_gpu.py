"""The CUDA path, for a machine with a GPU (`pytest -m gpu`; skipped elsewhere, conftest.py): a real training
run in bf16 on the device (the cuDNN attention backend off, run/setup.load_model: docs/benchmarks.md "On a
GPU"), and the lean decode step equal to the Hugging Face forward bit for bit there too. Each test also runs
on the CPU (the `cpu` cases), so the test itself is checked on every machine, except the run sampling from a
CUDA graph (rollout.cuda_graph), which needs a GPU (its fixed-shape step is checked on the CPU in
test_graphed.py)."""

from __future__ import annotations

import json

import pytest
import torch
from adapter_helpers import GQA_ARCHS

from projected_grpo.cli import main
from projected_grpo.organism.build import build_tokenizer, tiny_model
from projected_grpo.organism.warmup import builtin_corpus
from projected_grpo.run import metrics
from projected_grpo.sampling.generate import generate

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 0.2M-parameter Llama and its ChatML tokenizer, saved in bf16 as a Hugging Face directory."""
    out = tmp_path_factory.mktemp("bf16-llama")
    tok = build_tokenizer(builtin_corpus().texts(), vocab_size=1024)
    tiny_model(tok, hidden=64, layers=2, heads=4).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_train_runs_in_bf16_on_the_device(device, model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--model", str(model_dir), "--model.dtype", "bfloat16",
                 "--model.device", device, "--arm", "erase", "--run.steps", "3", "--run.dir", str(run)]) == 0
    rows = metrics.read_rows(run / metrics.METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["time/step"] > 0 and r["completion/mean_len"] > 0 for r in rows)
    summary = json.loads((run / metrics.SUMMARY_FILE).read_text())
    assert summary["arm"] == "erase"
    if device == "cuda":  # decode shapes change every token: cuDNN would build a graph for each
        assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
def test_train_with_cuda_graph_sampling(model_dir, tmp_path):
    """rollout.cuda_graph through the whole loop (students and evals sampled from a replayed graph): the
    policy's ratio to what was sampled stays 1 up to the fixed-shape step's rounding (sampling/graphed.py)."""
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--model", str(model_dir), "--model.device", "cuda",
                 "--rollout.cuda-graph", "--arm", "none", "--run.steps", "3", "--run.dir", str(run)]) == 0
    rows = metrics.read_rows(run / metrics.METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["completion/mean_len"] > 0 and 0 <= r["sample/kl"] < 1e-6 for r in rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_lean_generate_equals_hf_on_the_device(device, dtype):
    torch.manual_seed(0)
    model = GQA_ARCHS["llama_sdpa"]().to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen a random init's near-uniform logits
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # left padding: a mask every step
    args = dict(max_new_tokens=12, seed=[3, 4, 5], eos_id=[], pad_id=0)
    a = generate(model, prompts, 2, lean=True, **args)
    b = generate(model, prompts, 2, lean=False, **args)
    assert all(torch.equal(x, y) for x, y in zip(a.completion_ids, b.completion_ids, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.logp, b.logp, strict=True))
    assert len({tuple(c.tolist()) for c in a.completion_ids}) > 1  # the draws depend on the logits
