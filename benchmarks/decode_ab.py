"""Interleaved A/B of the decode: HF forward per token vs decode_step.lean_step, in one process.

Checks first that both give the same ids and log-probs, then alternates the two paths for --rounds rounds
(the order flips each round) and prints medians: whole `generate` calls, and the per-token step alone on a
prefilled cache. Only same-process ratios mean anything on shared cores.

Run: PYTHONPATH=src .venv/bin/python benchmarks/decode_ab.py [--model-dir DIR] [--rounds 10]
(no --model-dir: the bench Llama of vs_trl.py, hidden 256, 4 layers, built into a temporary directory)
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from projected_grpo.sampling.decode_step import hf_step, lean_step
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.kv_cache import KV_CACHES, cache_of, with_cache
from projected_grpo.sampling.pack import left_pad, position_ids_from_mask

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3, [5, 6, 7, 8, 9] * 4]  # 30 and 20 tokens: left padding


def _generate_ms(model, lean: bool, n: int, samples: int, new: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        generate(model, PROMPTS, samples, max_new_tokens=new, seed=0, eos_id=[], pad_id=0, share_prefill=True,
                 lean=lean)
    return (time.perf_counter() - t0) / n * 1e3


def _step_ms(model, lean: bool, samples: int, new: int) -> tuple[float, torch.Tensor]:
    """ms per token of `new` greedy steps on a prefilled cache (no sampling), and the last logits."""
    rows = [p for p in PROMPTS for _ in range(samples)]
    ids, prompt_mask = left_pad(rows, max(map(len, rows)), 0)
    mask = torch.cat([prompt_mask, torch.ones((len(rows), new), dtype=torch.long)], 1)
    pos = position_ids_from_mask(prompt_mask)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True,
                    **with_cache(model, KV_CACHES["preallocated"](model, mask.shape[1])), logits_to_keep=1)
        past, logits, pos, n = cache_of(out), out.logits[:, -1], pos[:, -1:], ids.shape[1]
        step = lean_step(model, past, mask) if lean else hf_step(model, past, mask, {"logits_to_keep": 1})
        if step is None:
            sys.exit("this model is not on decode_step's allow-list: nothing to compare")
        t0 = time.perf_counter()
        for _ in range(new):
            pos, n = pos + 1, n + 1
            logits = step(logits.argmax(-1), pos, n)
        return (time.perf_counter() - t0) / new * 1e3, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=5, help="generate calls per round and path")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=32, help="new tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-generate", action="store_true", help="time the step alone (big models)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if not model_dir:
            sys.path.insert(0, str(pathlib.Path(__file__).parent))
            from vs_trl import build_model

            model_dir = str(pathlib.Path(tmp) / "bench")
            build_model(pathlib.Path(model_dir), 256, 4)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    a, b = (generate(model, PROMPTS, args.samples, max_new_tokens=args.new, seed=0, eos_id=[], pad_id=0,
                     share_prefill=True, lean=lean) for lean in (True, False))
    same = all(map(torch.equal, a.completion_ids, b.completion_ids)) and all(map(torch.equal, a.logp, b.logp))
    assert same, "paths differ"
    assert torch.equal(_step_ms(model, True, args.samples, 4)[1], _step_ms(model, False, args.samples, 4)[1])
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for lean in ((True, False) if r % 2 else (False, True)):
            if not args.no_generate:
                times.setdefault(("generate", lean), []).append(
                    _generate_ms(model, lean, args.per_round, args.samples, args.new))
            times.setdefault(("step", lean), []).append(_step_ms(model, lean, args.samples, args.new)[0])
    for what in ("generate", "step"):
        if (what, True) in times:
            hf, lean = statistics.median(times[what, False]), statistics.median(times[what, True])
            print(f"{what:8s} HF {hf:8.2f} ms  lean {lean:8.2f} ms  lean/HF {lean / hf:.3f}  "
                  f"(medians of {args.rounds} rounds, {len(PROMPTS) * args.samples} rows)")


if __name__ == "__main__":
    main()
