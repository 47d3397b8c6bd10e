"""One trainer's timed GRPO run for benchmarks/vs_trl.py, alone in its process so its peak RSS is its own.

    python benchmarks/_vs_trl_worker.py SPEC_JSON OUT_JSON

SPEC_JSON (written by vs_trl.py) names the trainer ("ours" or "trl"), the model directory, the loss,
beta and the shared GRPO settings. OUT_JSON receives per-step wall times, completion tokens per step,
the per-phase times ours logs, and this process's peak RSS (`ru_maxrss`, children excluded: our
sandbox workers are separate processes, counted by the parent's process-tree sampler instead).

Both trainers get the same prompts (the built-in problems' chat messages, rendered by the same
tokenizer's chat template; the ids are checked equal), the same reward callable (`string_reward`),
group size, completion length, learning rate, loss, beta, clip epsilon 0.2, k3 KL; fp32 on CPU unless
the spec names another "device" (cuda) and "dtype" (bfloat16: ours loads the frozen base in bf16, knobs fp32;
TRL trains with `bf16=True` on the checkpoint's own dtype). On CUDA, OUT_JSON also holds the GPU's peak
allocated memory (`gpu_peak_mb`) and each step's time is taken after a device synchronize.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import sys
import tempfile
import time
from collections import defaultdict


def string_reward(text: str) -> float:
    """Deterministic reward of a completion's text: the share of distinct characters in it.

    Continuous, so a group of G sampled completions almost never has zero reward variance: both trainers
    then do a full backward every step (ours would otherwise skip zero-variance groups, TRL would not).
    Free to compute, so step time is the trainers' own cost, not grading.
    """
    return len(set(text)) / max(1, len(text))


class Phases:
    """Process CPU time by phase of a step, for `spec["profile"]`: chosen functions are wrapped so the CPU
    time spent inside them counts to their phase (exclusively: a timed function called inside another
    counts to the inner one); what no wrapped function covers is the step's overhead."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[str] = []
        self.t = 0.0

    def _switch(self, push: str | None) -> None:
        now = time.process_time()
        if self.stack:
            self.total[self.stack[-1]] += now - self.t
        if push is None:
            self.stack.pop()
        else:
            self.stack.append(push)
        self.t = now

    def timed(self, fn, phase):
        """fn, its CPU time counted to `phase` (a str, or fn(*args, **kwargs) -> str)."""

        def timed(*args, **kwargs):
            self._switch(phase if isinstance(phase, str) else phase(*args, **kwargs))
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch(None)

        return timed

    def wrap(self, owner, attr: str, phase) -> None:
        """owner.attr counts to `phase`."""
        setattr(owner, attr, self.timed(getattr(owner, attr), phase))

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


def _score_phase(*args, **kwargs) -> str:
    """A log-prob forward with grad is the training forward; without, the reference (or old-policy) one."""
    import torch

    return "forward" if torch.is_grad_enabled() else "reference"


def _common_phases(ph: Phases) -> None:
    import torch

    ph.wrap(torch.Tensor, "backward", "backward")
    ph.wrap(torch.optim.AdamW, "step", "optimizer")


def _per_step(snaps: list[dict[str, float]], cpu_s: list[float]) -> dict[str, list[float]]:
    """Per-step phase CPU seconds from the cumulative snapshots at each step's end (step 0 dropped, as
    cpu_s), plus `overhead`: the step's CPU time that no phase covers."""
    names = sorted({k for s in snaps for k in s})
    out = {k: [b.get(k, 0.0) - a.get(k, 0.0) for a, b in zip(snaps, snaps[1:])] for k in names}
    out["overhead"] = [c - sum(out[k][i] for k in names) for i, c in enumerate(cpu_s)]
    return out


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _sync(spec: dict) -> None:
    """Wait for the GPU's queued work, so a step's wall time is the step's (CUDA runs asynchronously)."""
    import torch

    if spec.get("device", "cpu").startswith("cuda"):
        torch.cuda.synchronize()


def reward(prompts, completions, **kwargs) -> list[float]:
    """The one reward both trainers call, in TRL's reward-function contract (ours wraps it as an
    environment: envs.base.RewardFnEnv, `--env.name reward_fn --env.reward-fn _vs_trl_worker:reward`)."""
    return [string_reward(c if isinstance(c, str) else c[-1]["content"]) for c in completions]


def write_prompts(path: pathlib.Path) -> pathlib.Path:
    """The built-in problems' chat messages as a prompts JSONL (one {"id", "prompt": messages} per line)."""
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.envs.coding.prompts import build_messages

    path.write_text("".join(json.dumps({"id": p.id, "prompt": build_messages(p)}) + "\n"
                            for p in BUILTIN_PROBLEMS))
    return path


def run_ours(spec: dict) -> dict:
    """run.train.train on the saved model (knob kind/rank of the spec, arm none, no teacher rows), with the
    reward callable as its environment."""
    import projected_grpo.run.train as T
    from projected_grpo import config as C
    from projected_grpo.run import metrics

    cpu_marks: list[float] = []  # process CPU time at each step's metrics row (the row closes the step)
    snaps: list[dict[str, float]] = []
    log = metrics.MetricsLogger.log
    ph = Phases() if spec.get("profile") else None
    if ph is not None:
        from projected_grpo.envs.base import RewardFnEnv
        from projected_grpo.sampling import sample

        _common_phases(ph)
        ph.wrap(sample, "generate", "generate")
        ph.wrap(RewardFnEnv, "grade", "reward")
        if hasattr(T, "scoring"):  # the loop's scoring forward (packed or prefix-shared), chosen at its setup
            make = T.scoring
            T.scoring = lambda *a, **k: (s := make(*a, **k))._replace(logprobs=ph.timed(s.logprobs,
                                                                                      _score_phase))
        else:  # before sampling/prefix.py (profiling an older commit): the packed forward, called directly
            ph.wrap(T, "forward_logprobs", _score_phase)

    def timed_log(self, step, row):
        cpu_marks.append(time.process_time())
        if ph is not None:
            snaps.append(ph.snapshot())
        return log(self, step, row)

    metrics.MetricsLogger.log = timed_log
    run_dir = pathlib.Path(spec["tmp"]) / f"ours-{os.getpid()}"
    adv = {"dr_grpo": "dr_grpo", "grpo": "grpo"}[spec["loss"]]  # TRL pairs dr_grpo with scale_rewards=none
    # rollout.share_prefix is newer than some commits benchmarked (step_before_after.py): passed where known
    has_share = "share_prefix" in C.RolloutCfg.__dataclass_fields__
    share = {"share_prefix": spec["share_prefix"]} if has_share else {}
    if spec.get("sample_dtype", "model") != "model":  # rollout.sample_dtype (newer still): only when set
        share["sample_dtype"] = spec["sample_dtype"]
    if spec.get("cuda_graph"):  # rollout.cuda_graph (newer again): only when set
        share["cuda_graph"] = True
    cfg = C.Config(
        model=C.ModelCfg(source="hf", path=spec["model_dir"], cache_dir=spec["cache_dir"], knob=spec["knob"],
                         rank=spec["rank"], grad_checkpointing=spec["ckpt"],
                         device=spec.get("device", "cpu"), dtype=spec.get("dtype", "float32")),
        env=C.EnvCfg(name="reward_fn", reward_fn="_vs_trl_worker:reward",
                     problems=str(write_prompts(pathlib.Path(spec["tmp"]) / f"prompts-{os.getpid()}.jsonl"))),
        rollout=C.RolloutCfg(prompts_per_step=spec["B"], group_size=spec["G"], mix=0.0,
                             max_new_tokens=spec["max_new"], temperature=1.0, top_p=1.0,
                             micro_prompts=spec.get("micro", 0), **share),
        loss=C.LossCfg(advantage=adv, aggregation=spec["loss"], kl="k3", beta=spec["beta"]),
        optim=C.OptimCfg(lr=spec["lr"]),
        run=C.RunCfg(steps=spec["steps"], seed=spec["seed"], dir=str(run_dir), threads=spec["threads"],
                     checkpoint_every=spec["steps"]),
    )
    T.train(cfg)
    rows = metrics.read_rows(run_dir / metrics.METRICS_FILE)
    n = spec["B"] * spec["G"]
    # CPU time of step k = mark k - mark k-1, so step 0 has none (it is dropped as warm-up anyway)
    cpu_s = [b - a for a, b in zip(cpu_marks, cpu_marks[1:])]
    return {"step_s": [r["time/step"] for r in rows], "cpu_s": cpu_s,
            "phases_cpu": _per_step(snaps, cpu_s) if ph is not None else {},
            "tokens": [r["completion/mean_len"] * n for r in rows],
            "phases": {k: [r[f"time/{k}"] for r in rows] for k in ("generate", "grade", "backward")}}


def run_trl(spec: dict) -> dict:
    """trl.GRPOTrainer on the model loaded from its directory: full fine-tuning (its default; with beta > 0 a
    second copy is the reference), or PEFT LoRA of rank spec["trl_lora_r"] (the reference: adapters off)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.envs.coding.prompts import build_messages
    from projected_grpo.sampling.pack import prompt_text_and_ids

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    for p in BUILTIN_PROBLEMS[:3]:  # TRL renders conversational prompts with the same chat template
        ours = prompt_text_and_ids(tok, build_messages(p))[1]
        theirs = list(tok.apply_chat_template([build_messages(p)], add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"][0])
        if ours != theirs:
            raise RuntimeError(f"prompt ids differ between trainers for problem {p.id}: "
                               f"{ours[:8]} vs {theirs[:8]}")

    times: list[float] = []
    cpu: list[float] = []
    logs_seen: list[dict] = []
    snaps: list[dict[str, float]] = []
    ph = Phases() if spec.get("profile") else None
    if ph is not None:
        _common_phases(ph)
        ph.wrap(GRPOTrainer, "_generate_single_turn", "generate")
        ph.wrap(GRPOTrainer, "_calculate_rewards", "reward")
        ph.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", _score_phase)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync(spec)
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            if ph is not None:
                self.s0 = ph.snapshot()

        def on_step_end(self, args, state, control, **kw):
            _sync(spec)
            times.append(time.perf_counter() - self.t0)
            cpu.append(time.process_time() - self.c0)
            if ph is not None:
                snaps.extend([self.s0, ph.snapshot()])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                logs_seen.append(dict(logs))

    rows = spec["B"] * spec["G"]
    micro = spec.get("trl_micro") or rows  # rows per micro-batch; accumulated to the step's rows
    if rows % micro:
        raise ValueError(f"--trl-micro {micro} must divide the step's {rows} rows")
    args = GRPOConfig(
        output_dir=str(pathlib.Path(spec["tmp"]) / f"trl-{os.getpid()}"),
        use_cpu=spec.get("device", "cpu") == "cpu", bf16=spec.get("dtype", "float32") == "bfloat16",
        fp16=False, per_device_train_batch_size=micro, num_generations=spec["G"],
        gradient_accumulation_steps=rows // micro, max_completion_length=spec["max_new"], temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=spec["lr"], beta=spec["beta"], loss_type=spec["loss"],
        scale_rewards="none" if spec["loss"] == "dr_grpo" else "group",
        epsilon=0.2, max_grad_norm=1.0, max_steps=spec["steps"], logging_steps=1, save_strategy="no",
        report_to="none", seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0,
    )
    ds = Dataset.from_list([{"prompt": build_messages(p)} for p in BUILTIN_PROBLEMS])
    peft = None
    if spec.get("trl_lora_r"):  # PEFT LoRA on the projections our knobs wrap; reference = adapters off
        from peft import LoraConfig

        from projected_grpo.knobs.adapters import DEFAULT_TARGETS

        r = spec["trl_lora_r"]
        peft = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(DEFAULT_TARGETS[:7]),
                          task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Timer()], peft_config=peft)
    trainer.train()
    n = spec["B"] * spec["G"]
    if len(logs_seen) != len(times):
        raise RuntimeError(f"TRL logged {len(logs_seen)} steps with completion lengths but ran {len(times)}")
    tokens = [r["completions/mean_length"] * n for r in logs_seen]
    phases_cpu = {}
    if ph is not None:  # each step from its own begin/end snapshots (callbacks outside steps are not counted)
        per = [_per_step(snaps[i:i + 2], cpu[i // 2:i // 2 + 1]) for i in range(0, len(snaps), 2)][1:]
        phases_cpu = {k: [p.get(k, [0.0])[0] for p in per] for k in {k for p in per for k in p}}
    return {"step_s": times, "cpu_s": cpu[1:], "tokens": tokens, "phases": {}, "phases_cpu": phases_cpu}


RUNNERS = {"ours": run_ours, "trl": run_trl}


def main(argv: list[str]) -> int:
    spec = json.loads(pathlib.Path(argv[0]).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    out = RUNNERS[spec["trainer"]](spec)
    out |= {"trainer": spec["trainer"], "wall_s": time.perf_counter() - t0, "peak_rss_mb": _peak_rss_mb()}
    if spec.get("device", "cpu").startswith("cuda"):
        out["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    tmp = tempfile.NamedTemporaryFile("w", dir=pathlib.Path(argv[1]).parent, delete=False, suffix=".tmp")
    with tmp:
        json.dump(out, tmp)
    os.replace(tmp.name, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
