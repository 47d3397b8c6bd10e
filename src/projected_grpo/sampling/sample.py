"""sample -> decode -> grade: the one path from a model to graded completions.

`sample_and_grade` samples (generate.py), decodes and grades through the environment; students, the
deployed view, evals, teacher pools and organism checks use it, and its `Sample` is the one record of a
completion in a group (teacher pool rows become Samples too).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from projected_grpo.envs.base import Graded
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.pack import Ids
from projected_grpo.sampling.packed import auto_dtype

# rollout.sample_dtype -> generate's sample_dtype (None: the model's own weights); "auto": concrete_dtype
SAMPLE_DTYPES = {"model": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def concrete_dtype(sample_dtype: str, device: str | torch.device) -> str:
    """rollout.sample_dtype with "auto" resolved for a model on `device` (packed.auto_dtype); others as is."""
    return auto_dtype(str(device)) if sample_dtype == "auto" else sample_dtype


@dataclass(frozen=True, eq=False)
class Sample:
    """One graded completion of a group, student or teacher: what the loss packs and the metrics count.

    prompt_ids (T_p,) / completion_ids (T_c,): torch.long CPU token ids exactly as packed (EOS included when
    emitted or stored); a group's samples of one prompt share its tensor, so nothing writes into them.
    text: the decoded completion the environment graded. logp_behaviour: (T_c,) float32, per completion
    token the log-prob it was sampled under, as the sampler returned it (a pool row's JSON list becomes this
    tensor at the pool's edge; None for template teacher rows). truncated: hit max_new_tokens.
    student: sampled live by the policy (False: a frozen teacher pool row). Samples compare (and hash) by
    identity: their ids are tensors, compared with torch.equal.
    """

    problem_id: str
    mode: str
    prompt_ids: Tensor
    completion_ids: Tensor
    text: str
    logp_behaviour: Tensor | None
    truncated: bool
    student: bool
    grade: Graded


def sample_and_grade(model, tokenizer, env, problems: Sequence, prompt_ids: Mapping[str, Ids],
                     n_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                     seed: int | Sequence[int], clock: dict[str, float] | None = None,
                     share_prefill: bool = False, sample_dtype: str = "model",
                     cuda_graph: bool = False, retire: bool = False) -> list[Sample]:
    """Sample `n_samples` completions of every problem in one batch, decode, grade with `env`.

    prompt_ids: problem id -> its prompt's (T_p,) torch.long ids (setup.prompt_table), the tensor every
    Sample of the problem carries. Returns B * n_samples Samples, prompt-major (problem b's samples are rows
    b * n .. b * n + n - 1).
    seed: one for the batch, or one per problem (generate).
    The caller chooses the model's view (knobs.merged() / ablate_quarantine()) and no_grad. `clock`, when
    given, accumulates seconds under "generate" and "grade". share_prefill: generate's. sample_dtype:
    rollout.sample_dtype ("model", or "float32" / "bfloat16": generate's sample_dtype in that dtype; "auto":
    concrete_dtype's choice for the model's device).
    cuda_graph, retire: rollout.cuda_graph and rollout.retire (generate's).
    """
    t0 = time.perf_counter()
    dtype = SAMPLE_DTYPES[concrete_dtype(sample_dtype, next(model.parameters()).device)]
    ro = generate(model, [prompt_ids[p.id] for p in problems], n_samples, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, seed=seed, eos_id=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id, share_prefill=share_prefill,
                  sample_dtype=dtype, cuda_graph=cuda_graph, retire=retire)
    t1 = time.perf_counter()
    texts = tokenizer.batch_decode([c.tolist() for c in ro.completion_ids], skip_special_tokens=True)
    owners = [p for p in problems for _ in range(n_samples)]
    grades = env.grade(texts, owners)
    if clock is not None:
        clock["generate"] = clock.get("generate", 0.0) + t1 - t0
        clock["grade"] = clock.get("grade", 0.0) + time.perf_counter() - t1
    return [Sample(problem_id=p.id, mode=p.mode, prompt_ids=ro.prompt_ids[i],
                   completion_ids=ro.completion_ids[i], text=texts[i], logp_behaviour=ro.logp[i],
                   truncated=bool(ro.truncated[i]), student=True, grade=grades[i])
            for i, p in enumerate(owners)]
