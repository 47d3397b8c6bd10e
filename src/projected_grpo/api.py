"""The Python API: a preset config, a training run, a sweep and its report, in the shapes a TRL user knows.

    import projected_grpo as pg

    def brevity(prompts, completions, **columns):      # TRL's reward-function signature
        return [1.0 - len(c) / 200 for c in completions]

    cfg = pg.preset("smollm2-cpu", model="path/to/hf_model", run={"steps": 20, "dir": "runs/mine"})
    summary = pg.train(cfg, reward_fn=brevity, prompts=["Name a prime.", "Spell GRPO."])
    print(summary["reward/mean"])

Every function here calls what the CLI calls (`projected-grpo train` is `train(cfg)`), so a run started from
Python and one started from the command line with the same config are the same run. Not here: anything of
the method itself (run/train.py, knobs/, hack/).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.errors import UserError

Config = C.Config
PRESETS = presets.PRESETS


def preset(name: str = "smoke", *, model: str = "", **sections: Mapping[str, object]) -> C.Config:
    """A preset (PRESETS: smoke, demo, math-demo, smollm2-cpu, ...) with some fields changed, validated as
    the CLI validates them: `preset("demo", proj={"arm": "erase"}, run={"steps": 50})`. model: a Hugging Face
    model directory or a named model (smollm2), as `--model`."""
    if name not in PRESETS:
        raise UserError(f"preset {name!r} is not one of {list(PRESETS)}")
    if model:
        sections = {**sections, "model": {"source": "hf", "path": model, **dict(sections.get("model", {}))}}
    return C.resolve_auto(C.replace(PRESETS[name], **{k: dict(v) for k, v in sections.items()}))


def train(cfg: C.Config, *, reward_fn: Callable | None = None,
          prompts: Sequence[str | Sequence[Mapping[str, str]] | Mapping] | None = None) -> dict:
    """Train one run (GRPO, or PPO under loss.algo ppo; a DPO pass first under dpo.before); returns its
    summary (last-5-step means of every metric, also in <run.dir>/summary.json).

    reward_fn and prompts, given together, train on a TRL-style reward instead of cfg's environment:
    reward_fn(prompts=[...], completions=[...], **columns) -> one float per completion; prompts are strings,
    chat message lists, or dicts with a "prompt" and any other columns (passed to reward_fn by name). The
    run's config.json records the function as `module:qualname` (importable only if it lives in a module).
    A reward callable has no teacher pool and no hack labels: rollout.mix is set to 0 and proj.arm must be
    none (pairs for V_hack come from --proj.pairs FILE, not from a function)."""
    from projected_grpo.envs.base import PromptRow, RewardFnEnv
    from projected_grpo.run import dpo
    from projected_grpo.run.train import LOOPS

    if (reward_fn is None) != (prompts is None):
        raise UserError("train: give reward_fn and prompts together (or neither: cfg's environment)")
    env = None
    if reward_fn is not None:
        rows = []
        for i, p in enumerate(prompts):
            row = dict(p) if isinstance(p, Mapping) else {"prompt": p}
            if "prompt" not in row:
                raise UserError(f"train: prompts[{i}] is a dict without a 'prompt' key")
            rows.append(PromptRow(id=str(row.pop("id", i)), prompt=row.pop("prompt"), columns=row))
        env = RewardFnEnv(reward_fn, rows)
        module = getattr(reward_fn, "__module__", "python")
        qualname = getattr(reward_fn, "__qualname__", "fn")
        recorded = {"name": "reward_fn", "reward_fn": f"{module}:{qualname}", "problems": "<python>"}
        cfg = C.replace(cfg, rollout={"mix": 0.0}, env=recorded)
    cfg = C.resolve_auto(cfg)
    dpo.pass_before(cfg)
    return LOOPS[cfg.loss.algo](cfg, env=env)


def experiment(preset: str, arms: Sequence[str], seeds: int = 3, out: str | pathlib.Path = "",
               jobs: int = 0, **sections: Mapping[str, object]) -> str:
    """A sweep of `arms` (`projected-grpo arms` lists them) x seeds 0..seeds-1 on a preset (with `sections`
    changed), each run a `projected-grpo train` process, `jobs` at a time; returns the report's summary and
    writes <out>/report.md. The same as `projected-grpo experiment`."""
    from projected_grpo.study import experiment as E

    base = C.replace(PRESETS[preset], **{k: dict(v) for k, v in sections.items()}) if sections else \
        PRESETS[preset]
    out = out or f"runs/exp-{preset}"
    return E.sweep(base, list(arms), list(range(seeds)), out, preset=preset, jobs=jobs,
                   command=f"projected_grpo.experiment({preset!r}, {list(arms)!r}, seeds={seeds})")


def report(sweep_dir: str | pathlib.Path) -> str:
    """The markdown report of a finished sweep or study directory (its report.md)."""
    path = pathlib.Path(sweep_dir) / "report.md"
    if not path.is_file():
        raise UserError(f"{path}: no report; run the sweep (or rerun its command to finish it) first")
    return path.read_text(encoding="utf-8")
