"""One run's setup, shared by every entry point (train, experiment, build-pool, extract-direction, export).

Each function takes the whole `Config` and reads its fields as `cfg.<section>.<field>`:
  load_model     the policy and tokenizer (smoke model, the env's embedded organism (ORGANISMS), or a Hugging
                 Face directory)
  make_env       the environment named by env.name (ENVIRONMENTS), which owns its sandbox until close()
  wrap_knobs     freeze the model, wrap its Linears in knobs (starting from model.init_knobs, or the DPO
                 pass's knobs under dpo.before)
  prompt_table   problem id -> (chat-formatted prompt text, (T_p,) long ids) from the environment's messages
  open_pool      the teacher pool: a given file, or built once from the environment's templates
  mined_pairs    contrastive pairs mined from a graded pool file (V_hack's own resolution: hack/resolve.py)
Nothing here trains; the loop (train.py) calls these in order. docs/architecture.md shows the data path.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from safetensors import SafetensorError

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.envs.base import RewardFnEnv, load_reward_fn
from projected_grpo.errors import UserError
from projected_grpo.hack import pairs
from projected_grpo.knobs import adapters
from projected_grpo.run import pool as P
from projected_grpo.sampling.pack import as_ids, prompt_text_and_ids


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- model and environment ---------------------------------------------------------------------------------

def load_model(cfg: C.Config, tokenizer_only: bool = False):
    """(model or None, tokenizer) for cfg.model.source; the model in eval mode (no dropout in RL) on
    cfg.model.device. The tokenizer gets a pad token (its eos) when it has none: pad positions are masked."""
    from projected_grpo.organism import build as organism

    if cfg.model.source == "smoke":
        model, tok = organism.smoke_model_and_tokenizer(seed=cfg.run.seed)
    elif cfg.model.source == "organism":
        if cfg.env.name not in ORGANISMS:
            raise UserError(f"config: model.source='organism' has no organism for env.name={cfg.env.name!r} "
                            f"(there is one for {sorted(ORGANISMS)}); pass --model PATH")
        model, tok, _ = organism.load_organism(ORGANISMS[cfg.env.name](cfg))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from projected_grpo.models import resolve_model

        if not cfg.model.path:
            raise UserError("config: model.source='hf' needs model.path (pass --model PATH or a name)")
        path = resolve_model(cfg.model.path, cfg.model.cache_dir or None)  # a name (smollm2) or a directory
        gguf = {"gguf_file": cfg.model.gguf_file} if cfg.model.gguf_file else {}
        if not gguf:
            check_model_dir(path)
        with _model_dir_errors(path, "tokenizer"):
            tok = AutoTokenizer.from_pretrained(path, **gguf)
        with _model_dir_errors(path, "model"):
            model = None if tokenizer_only else AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, cfg.model.dtype), **gguf)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if cfg.model.device.startswith("cuda") and model is not None:
        # cuDNN's attention builds a graph per new shape, ~45-70 ms each on an H200 (torch 2.11, bf16), and
        # the decode's key length grows every token: 7 of our 8 s per SmolLM2 step went there; the other
        # backends take 0.06-0.17 ms per call (docs/benchmarks.md, "On a GPU"). Process-wide, so the lean
        # decode step and the HF forward it must equal choose among the same backends.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return (None if model is None else model.to(cfg.model.device).eval()), tok


# what a Hugging Face model directory needs: a config, weights, and a tokenizer (any one of its file sets)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str | pathlib.Path) -> None:
    """UserError naming what a local model directory lacks (config.json, weights, tokenizer files), before
    transformers reads it (its own errors on an incomplete directory are tracebacks of several lines)."""
    d = pathlib.Path(path)
    missing = [what for what, names in (("config.json", ("config.json",)), ("weights", WEIGHT_FILES),
                                        ("tokenizer", TOKENIZER_FILES))
               if not any((d / n).is_file() for n in names)]
    if missing:
        raise UserError(f"model directory {d} has no {', no '.join(missing)}: a Hugging Face model directory "
                        f"holds config.json, weights ({' or '.join(WEIGHT_FILES[::2])}) and a tokenizer "
                        f"({' or '.join(TOKENIZER_FILES)}, with tokenizer_config.json); save both with "
                        "save_pretrained")


@contextlib.contextmanager
def _model_dir_errors(path: str, what: str) -> Iterator[None]:
    """transformers' error reading a model directory's `what` as one UserError line naming the directory (a
    bad or truncated file there is the directory's fault, not the program's; --debug shows the traceback)."""
    try:
        yield
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"model directory {path}: cannot load its {what} ({type(e).__name__}: {first})"
                        ) from e


def _coding_organism(cfg: C.Config) -> pathlib.Path:
    from projected_grpo.organism import build

    return build.build_organism(cache_dir=cfg.model.cache_dir or None, log=_log)


def _maths_organism(cfg: C.Config) -> pathlib.Path:
    from projected_grpo.organism import maths

    if cfg.env.eval_size > maths.HELDOUT:
        raise UserError(f"config: env.eval_size={cfg.env.eval_size} > {maths.HELDOUT}, the eval problems the "
                        "maths organism's warm-up leaves out; lower it (or train another model)")
    spec = maths.MathsOrganismConfig(warmup_levels=cfg.env.warmup_levels, train_levels=cfg.env.train_levels)
    return maths.build_maths_organism(spec, cache_dir=cfg.model.cache_dir or None, log=_log)


# env.name -> the embedded organism built (or found in the cache) for it: model.source = "organism"
ORGANISMS: dict[str, Callable[[C.Config], pathlib.Path]] = {"coding": _coding_organism,
                                                            "maths": _maths_organism}


def _coding_env(cfg: C.Config):
    from projected_grpo.envs.coding.env import CodeEnv, load_problems

    problems = load_problems(cfg.env.problems, cfg.env.modes, cfg.env.max_problems)
    return CodeEnv(problems, reward_shape=cfg.env.reward_shape, timeout_s=cfg.env.timeout_s,
                   workers=cfg.env.workers)


def _maths_env(cfg: C.Config):
    from projected_grpo.envs.maths.env import MathEnv

    problems = "arithmetic" if cfg.env.problems == "builtin" else cfg.env.problems  # the coding default
    return MathEnv(problems=problems, modes=cfg.env.modes or ("strict",),
                   curriculum_steps=cfg.env.curriculum_steps, eval_size=cfg.env.eval_size,
                   max_problems=cfg.env.max_problems, seed=cfg.run.seed, data_dir=cfg.env.data_dir or None,
                   warmup_levels=cfg.env.warmup_levels, train_levels=cfg.env.train_levels)


def _reward_fn_env(cfg: C.Config):
    return RewardFnEnv.from_jsonl(load_reward_fn(cfg.env.reward_fn), cfg.env.problems, cfg.env.max_problems)


# env.name -> constructor from the config; an environment is closed by its user (`with closing(env)`)
ENVIRONMENTS: dict[str, Callable[[C.Config], object]] = {"coding": _coding_env, "maths": _maths_env,
                                                         "reward_fn": _reward_fn_env}


def make_env(cfg: C.Config):
    """The environment cfg.env.name names (ENVIRONMENTS); close it when done (it may own a sandbox)."""
    return ENVIRONMENTS[cfg.env.name](cfg)


DPO_DIR = "dpo"  # under dpo.before, the DPO pass's run directory inside the run's (run/dpo.py)
KNOBS_FILE = "knobs.safetensors"  # a DPO run's final knobs (Knobs.save)


def start_knobs(cfg: C.Config) -> str:
    """The knob file the run starts from: the DPO pass's under dpo.before, else model.init_knobs ("": 0)."""
    if cfg.dpo.before:
        if not cfg.run.dir:
            raise UserError("config: dpo.before puts the DPO pass in <run.dir>/dpo: pass --run-dir")
        return str(pathlib.Path(cfg.run.dir) / DPO_DIR / KNOBS_FILE)
    return cfg.model.init_knobs


def wrap_knobs(cfg: C.Config, model) -> adapters.Knobs:
    """Freeze `model` and wrap its target Linears in cfg.model.knob knobs (SVDs cached in the cache root), set
    to the values of `start_knobs(cfg)` when there is one (a file for another model is refused), with
    gradient checkpointing when cfg.model.grad_checkpointing (every training loop gets it here)."""
    knobs = adapters.wrap(model, kind=cfg.model.knob, targets=cfg.model.targets or adapters.DEFAULT_TARGETS,
                          rank=cfg.model.rank or None, cache_dir=cache_dir(cfg) / "svd", seed=cfg.run.seed)
    if path := start_knobs(cfg):
        if not pathlib.Path(path).is_file():
            raise UserError(f"{'dpo.before' if cfg.dpo.before else 'model.init_knobs'}: {path}: no such knob "
                            "file (a Knobs.save safetensors file, e.g. a run's ckpt-*/knobs.safetensors)")
        try:
            knobs.load(path)
        except ValueError as e:
            raise UserError(f"{'dpo.before' if cfg.dpo.before else 'model.init_knobs'}: {e}") from e
    if cfg.model.grad_checkpointing:  # recompute decoder activations in the backward; capture still works
        knobs.gradient_checkpointing(True)
    return knobs


def cache_dir(cfg: C.Config) -> pathlib.Path:
    return store.cache_root(cfg.model.cache_dir or None)


def prompt_table(env, tokenizer, problems: Sequence) -> dict[str, tuple[str, torch.Tensor]]:
    """problem id -> (prompt text, prompt ids (T_p,) torch.long), encoded with the tokenizer's chat template:
    the tensor every Sample of the problem carries (sampling/sample.py)."""
    out = {}
    for p in problems:
        text, ids = prompt_text_and_ids(tokenizer, env.messages(p))
        out[p.id] = (text, as_ids(ids))
    return out


# --- teacher pool ------------------------------------------------------------------------------------------

def template_counts(cfg: C.Config) -> dict[str, int]:
    return {"hack": cfg.pool.n_hack, "clean": cfg.pool.n_clean, "buggy": cfg.pool.n_buggy}


def build_template_pool(cfg: C.Config, env, tokenizer, problems: Sequence, prompts: dict,
                        path: pathlib.Path) -> list[dict]:
    """Template rows of `problems`, graded once, written to `path`; returns them."""
    rows = P.template_rows(env, problems, tokenizer, prompts, template_counts(cfg))
    P.write_pool(path, rows)
    return rows


def open_pool(cfg: C.Config, env, tokenizer, problems: Sequence, prompts: dict,
              run_dir: pathlib.Path) -> P.TeacherPool:
    """The run's teacher pool: cfg.pool.path, else template rows built once into run_dir/pool.jsonl
    (only when teacher rows are drawn, G_t > 0)."""
    path = pathlib.Path(cfg.pool.path or run_dir / "pool.jsonl")
    if not cfg.pool.path and not cfg.rollout.G_t:
        return P.EMPTY_POOL
    if not cfg.pool.path and not path.exists():
        build_template_pool(cfg, env, tokenizer, problems, prompts, path)
    return P.load_pool(path, tokenizer, problems, {i: ids for i, (_, ids) in prompts.items()})


# --- pairs from a pool ----------------------------------------------------------------------------------

def mined_pairs(pool_path: str, tokenizer, problems: Sequence, prompt_ids: dict, known_modes: Sequence[str],
                detectors: Sequence[str] = ("E",), per_problem: int = 2) -> tuple[list[pairs.Pair], dict]:
    """Pairs mined from a pool file over `problems` with the known modes' detectors (pairs.pairs_from_pool,
    the weak-detector rule) and the mining stats; the pool is validated and drift-checked as training loads
    it."""
    rows = P.load_pool(pool_path, tokenizer, problems, prompt_ids).rows
    return pairs.pairs_from_pool(rows, known_modes, detectors, per_problem)
