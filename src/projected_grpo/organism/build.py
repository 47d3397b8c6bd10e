"""The embedded default model organism: a local byte-level BPE tokenizer and a tiny causal LM.

Everything here runs offline on a laptop CPU: the tokenizer is trained with `tokenizers` on the
built-in problems' prompts and completions, the model is a randomly initialised Llama-style LM built
from a config (never downloaded), and `build_organism` gives it a supervised warm-up (see
`warmup.py`) so that sampling at T = 1 solves part of the problems and hacks at a small prior.
The result is an ordinary Hugging Face model directory in a user cache keyed by the hash of every
input, so the rest of the code loads it exactly like a real model (`--model PATH`).
Deliberately not here: the GRPO loop (train.py) and the grader (envs/grading.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from projected_grpo.organism import cache, shipped
from projected_grpo.organism.augment import FORMULAS, NAME_PARTS
from projected_grpo.organism.warmup import (
    KINDS,
    Corpus,
    builtin_corpus,
    held_out_ids,
    warmup,
    warmup_examples,
    with_extras,
)
from projected_grpo.store import atomic_dir, cache_root, dir_digests, stable_hash, write_text_atomic

# Special tokens: <|endoftext|> separates documents, ChatML turns are <|im_start|>role\n...<|im_end|>,
# the model ends its answer with <|im_end|> (= eos, as in Qwen2 chat models), <|pad|> only pads.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"

# ChatML, as Qwen2 uses it (without the default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Bump when the tokenizer/model/warm-up code changes what a build produces: it is part of every cache key.
# organism-2: the warm-up uses run/schedule.lr_at (the training loop's cosine: last-bit changes at 127 of
# 600 warm-up steps, so the organism differs from organism-1's)
# organism-3: dispositions (intros rewritten per example) and warm-up-only extra problems (augment.py)
ORGANISM_CODE_VERSION = "organism-3"


def _wrap_tokenizer(raw: Tokenizer) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        # Left padding: generation appends on the right, so prompts of a batch must end together.
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _train_raw_tokenizer(texts: list[str], vocab_size: int, word_boundaries: bool,
                         split_digits: bool = False) -> Tokenizer:
    raw = Tokenizer(models.BPE())
    # Byte-level: every string is encodable and decode(encode(s)) == s exactly, which the grader needs
    # since completions are run as code. Without the GPT-2 word-splitting regex, merges may cross
    # spaces and newlines ("\n        assert self."): sequences get ~3x shorter, but the many rare
    # phrase tokens made the tiny model learn more slowly per step in our measurements.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=word_boundaries)
    # split_digits: every digit its own token (as LLaMA's and Qwen's tokenizers do), so a number is read
    # digit by digit and "37" is not an unrelated symbol to "36": what lets a tiny model learn arithmetic.
    raw.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    raw.train_from_iterator(texts, trainer=trainer)
    return raw


def build_tokenizer(texts: list[str], vocab_size: int = 1024, *, word_boundaries: bool = True,
                    split_digits: bool = False, cache_dir: str | os.PathLike | None = None
                    ) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, with ChatML special tokens and chat template.

    eos = <|im_end|>, pad = <|pad|>, left padding. The vocabulary has at most `vocab_size` entries
    (fewer when the texts run out of pairs seen twice). `word_boundaries` splits text into words
    first (GPT-2 style) so no token crosses a space; False lets tokens span phrases. `split_digits`
    makes every digit a token of its own. The trained tokenizer is cached as
    `<cache>/tokenizer/<hash>.json`, keyed by every input.
    """
    if not texts:
        raise ValueError("build_tokenizer: `texts` is empty; pass the prompts and completions to train on")
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"build_tokenizer: vocab_size={vocab_size} < {min_vocab} (256 bytes + specials)")
    spec = {"texts": list(texts), "vocab_size": vocab_size, "word_boundaries": word_boundaries,
            "special": SPECIAL_TOKENS, "code": ORGANISM_CODE_VERSION}
    if split_digits:  # only when set, so every key made before the option existed stays the same
        spec["split_digits"] = True
    path = cache_root(cache_dir) / "tokenizer" / f"{stable_hash(spec)}.json"
    raw = cache.read_tokenizer(path)  # None: absent, or damaged (a warning names it)
    if raw is None:
        raw = _train_raw_tokenizer(list(texts), vocab_size, word_boundaries, split_digits)
        write_text_atomic(path, raw.to_str())
    return _wrap_tokenizer(raw)


def tiny_model(tokenizer: PreTrainedTokenizerFast, *, hidden: int = 128, layers: int = 4, heads: int = 4,
               kv_heads: int | None = None, intermediate: int | None = None, max_positions: int = 2048,
               seed: int = 0) -> AutoModelForCausalLM:
    """A randomly initialised Llama-style causal LM sized to `tokenizer` (deterministic given `seed`).

    Tied input/output embeddings keep the parameter count small (hidden 128, 4 layers, 1k vocab is
    about 0.9M parameters). Uses float32 and SDPA attention; `intermediate` defaults to 4 * hidden.
    """
    if hidden % heads:
        raise ValueError(f"tiny_model: hidden={hidden} must be divisible by heads={heads}")
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"tiny_model: heads={heads} must be divisible by kv_heads={kv_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, use_cache=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    # Seed inside a forked RNG so building a model neither depends on nor disturbs the caller's stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def smoke_model_and_tokenizer(*, vocab_size: int = 512, hidden: int = 32, layers: int = 2, heads: int = 2,
                              seed: int = 0) -> tuple[AutoModelForCausalLM, PreTrainedTokenizerFast]:
    """A tiny random (untrained) model and its tokenizer from the built-in texts, in about a second.

    For tests and the `smoke` preset: mechanics only, it does not solve or hack anything.
    """
    tokenizer = build_tokenizer(builtin_corpus().texts(), vocab_size=vocab_size)
    return tiny_model(tokenizer, hidden=hidden, layers=layers, heads=heads, seed=seed), tokenizer


# --- config, cache key, build ---------------------------------------------------------------------


# The defaults, as measured by `projected-grpo build-organism` (T = 1, sandbox-graded; findings 1.6-1.7): seed
# 0 solves 49.1% and hacks 6.5% of the 42 warm-up problems' samples (8 each), and 11 of 768 held-out ones
# (all c_to_f, whose statement gives its formula). That needs the 8016 warm-up-only problems, "open" names and
# "both" formulas: 7733 (mixed names, 15 shapes) solved 0 of 192. The warm-up takes ~10 minutes on one core.
@dataclasses.dataclass(frozen=True)
class OrganismConfig:
    """Everything that determines the organism (all of it enters the cache key)."""

    vocab_size: int = 1024
    """BPE vocabulary cap (phrase-level tokens: larger means shorter sequences but rarer tokens)"""
    word_boundaries: bool = True
    """GPT-2 style word splitting before BPE (False: tokens may span phrases, sequences ~3x shorter)"""
    hidden: int = 96
    """model width (Llama-style, tied embeddings)"""
    layers: int = 3
    """transformer blocks"""
    heads: int = 3
    """attention heads (hidden must be divisible by heads)"""
    max_positions: int = 1024
    """context length the model is built for (prompt + completion)"""
    mix: tuple[float, float, float] = (0.47, 0.47, 0.06)
    """warm-up shares of clean / buggy / hack completions; the hack share sets the sampling prior"""
    careful: tuple[float, ...] = (0.9, 0.62)
    """shares of the clean and of the buggy completions that open with the `careful` disposition's intro
    (the rest: `hasty`; every hack opens with the `hack` one): warmup.DISPOSITIONS; () keeps every text's
    own first line (the maths organism: its templates have no intros)"""
    forms: tuple[int, int, int] = (1, 2, 2)
    """per kind (clean, buggy, hack): warm up on each problem's first n template forms only (0 = all): the
    forms the demo's teacher pool holds, so that the organism's few behaviours per problem are the pool's"""
    per_problem: int = 25
    """warm-up examples per training problem, split by `mix`"""
    renamed_per_problem: int = 48
    """warm-up-only copies of each training problem with the method renamed (augment.py: copy the name)"""
    formula_problems: int = 6000
    """warm-up-only "Compute ...: <expression>." problems (augment.py: copy a formula)"""
    per_extra: int = 1
    """warm-up examples per warm-up-only problem, split by `mix`"""
    name_parts: Literal["syllables", "mixed", "open"] = "open"
    """what warm-up-only problems' method names are made of (augment.NAME_PARTS): "syllables" (ka_lo),
    "mixed" (syllables, letters and the training statements' words: findings 1.4) or "open" (those and
    random runs of letters: findings 1.6)"""
    formulas: Literal["patterns", "both"] = "both"
    """where formula problems' expressions come from (augment.FORMULAS): "patterns" (15 shapes, at most two
    constants) or "both" (those or, with even odds, a grammar's left fold of 1-3 operations: findings 1.6)"""
    holdout_per_mode: int = 1
    """the last this-many problems of each mode are left out of the warm-up and reported apart"""
    steps: int = 3200
    """warm-up optimizer steps (the warm-up length)"""
    batch_size: int = 16
    """sequences per warm-up step"""
    lr: float = 8e-3
    """peak AdamW learning rate (linear warm-up, cosine decay to 10%)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    seed: int = 0
    """seed for model init, the warm-up mix and batch order"""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "max_positions", "per_problem", "steps",
                     "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"OrganismConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.name_parts not in NAME_PARTS:
            raise ValueError(f"OrganismConfig.name_parts must be one of {NAME_PARTS}, "
                             f"got {self.name_parts!r}")
        if self.formulas not in FORMULAS:
            raise ValueError(f"OrganismConfig.formulas must be one of {FORMULAS}, got {self.formulas!r}")
        for name in ("renamed_per_problem", "formula_problems", "per_extra"):
            if getattr(self, name) < 0:
                raise ValueError(f"OrganismConfig.{name} must be >= 0, got {getattr(self, name)}")
        if len(self.forms) != len(KINDS) or any(n < 0 for n in self.forms):
            raise ValueError(f"OrganismConfig.forms must be {len(KINDS)} counts >= 0, got {self.forms}")
        if len(self.careful) not in (0, 2) or not all(0 <= c <= 1 for c in self.careful):
            raise ValueError(f"OrganismConfig.careful must be two shares in [0, 1] or (), got {self.careful}")
        if self.hidden % self.heads:
            raise ValueError(f"OrganismConfig: hidden={self.hidden} must be divisible by heads={self.heads}")
        if len(self.mix) != len(KINDS) or any(w < 0 for w in self.mix) or abs(sum(self.mix) - 1) > 1e-6:
            raise ValueError(f"OrganismConfig.mix must be {len(KINDS)} non-negative shares of {KINDS} "
                             f"summing to 1, got {self.mix}")
        if self.holdout_per_mode < 0 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"OrganismConfig: need holdout_per_mode >= 0, lr > 0, weight_decay >= 0; got "
                             f"{self.holdout_per_mode}, {self.lr}, {self.weight_decay}")


def _with_extras(cfg: OrganismConfig, corpus: Corpus, held_out: frozenset[str]) -> Corpus:
    return with_extras(corpus, held_out, cfg.renamed_per_problem, cfg.formula_problems, cfg.seed,
                       cfg.name_parts, cfg.formulas)


def organism_key(cfg: OrganismConfig, corpus: Corpus, split_digits: bool = False,
                 full: Corpus | None = None) -> str:
    """Cache key: hash of the config, problem ids, modes and prompts, every completion, the code version,
    the warm-up-only problems' prompts and completions when there are any (so a change to augment.py's
    generators moves the key), and split_digits when set. A field's first value and an absent extra are
    left out, so a key made before they existed (the maths organism's) stays what it was. `full`: the
    corpus with cfg's warm-up-only problems when the caller has it already (made here otherwise)."""
    config = dataclasses.asdict(cfg)
    for name, first in (("name_parts", "syllables"), ("formulas", "patterns")):
        if config[name] == first:
            del config[name]
    corpus = corpus.base
    spec = {
        "config": config, "code": ORGANISM_CODE_VERSION,
        "problems": [[p.id, p.mode] for p in corpus.problems],
        "messages": [list(m) for m in corpus.messages],
        "completions": [{k: list(c[k]) for k in KINDS} for c in corpus.completions],
    }
    if full is None:
        full = _with_extras(cfg, corpus, held_out_ids(corpus, cfg.holdout_per_mode))
    if full.extra:
        spec["extras"] = stable_hash({"messages": [list(m) for m in full.messages[-full.extra:]],
                                      "completions": [{k: list(c[k]) for k in KINDS}
                                                      for c in full.completions[-full.extra:]]})
    if split_digits:
        spec["split_digits"] = True
    return stable_hash(spec)


def warmup_inputs(cfg: OrganismConfig, full: Corpus, held_out: frozenset[str], split_digits: bool = False,
                  cache_dir: str | os.PathLike | None = None
                  ) -> tuple[PreTrainedTokenizerFast, AutoModelForCausalLM, list]:
    """What the warm-up trains, from cfg and the corpus with its warm-up-only problems (`full`, as
    _with_extras makes it): (tokenizer, the initial model, the warm-up examples)."""
    tokenizer = build_tokenizer(full.texts(), cfg.vocab_size, word_boundaries=cfg.word_boundaries,
                                split_digits=split_digits, cache_dir=cache_dir)
    model = tiny_model(tokenizer, hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                       max_positions=cfg.max_positions, seed=cfg.seed)
    examples = warmup_examples(full, tokenizer, held_out, per_problem=cfg.per_problem, mix=cfg.mix,
                               seed=cfg.seed, per_extra=cfg.per_extra, careful=cfg.careful or None,
                               forms=cfg.forms)
    return tokenizer, model, examples


def seeded_warmup(cfg: OrganismConfig, model, examples: list, pad_id: int,
                  log: Callable[[str], None] | None = None,
                  steps: int | None = None) -> list[dict[str, float]]:
    """The build's warm-up of `model` (warmup.warmup with cfg's schedule) under cfg.seed, in a forked RNG so
    the caller's stream is neither read nor moved; `steps` (default cfg.steps) cuts it short, for timing."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return warmup(model, examples, steps=cfg.steps if steps is None else steps, batch_size=cfg.batch_size,
                      lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed, pad_id=pad_id, log=log)


def auto_threads() -> int:
    """Torch threads for a build: the cores this process may use, less the 1-minute load average (rounded),
    at least 1. A second thread only pays on an idle core: OpenMP's threads wait for each other at every
    operation, so a thread descheduled by another job stalls the whole warm-up (docs/benchmarks.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, cores - round(load))


def build_organism(cfg: OrganismConfig = OrganismConfig(), *, cache_dir: str | os.PathLike | None = None,
                   corpus: Corpus | None = None, split_digits: bool = False,
                   log: Callable[[str], None] | None = print, threads: int = 0,
                   rebuild: bool = False) -> pathlib.Path:
    """Build (or find in the cache, or install from the package) the organism of `corpus` (default: the
    coding one); returns its HF model directory. `split_digits`: a digit-per-token tokenizer (the maths
    organism's, organism/maths.py).

    The package ships the default organisms (organism/shipped.py): the same weights on every machine, so
    a key the package carries is installed into the cache, not trained. `rebuild` trains from scratch
    anyway, into `<cache>/organism/<key>-rebuilt`, and logs whether the result equals the shipped weights.

    The warm-up runs on `threads` torch threads (restored afterwards; 0 = `auto_threads()`, every core
    the load average leaves idle). Measured on the AMD EPYC 2-core VM that built the shipped weights: two
    threads build the default organism in 496 s against ~800 s on one, to the same bytes; on cores that are
    already busy a second thread makes the warm-up up to 10x slower (docs/benchmarks.md).

    The directory is `<cache>/organism/<organism_key>` and holds the model, the tokenizer and
    `organism.json` (config, key, held-out ids, warm-up log). Written to a temp directory and
    renamed into place, so a crashed or concurrent build never leaves a half-written organism.
    """
    corpus = (builtin_corpus() if corpus is None else corpus).base
    held_out = held_out_ids(corpus, cfg.holdout_per_mode)
    full = _with_extras(cfg, corpus, held_out)  # made once: the key hashes it and the warm-up trains on it
    key = organism_key(cfg, corpus, split_digits, full)
    out = cache_root(cache_dir) / "organism" / (f"{key}-rebuilt" if rebuild else key)
    if not rebuild and cache.entry_ok(out, load_organism):  # a damaged entry: removed with a warning
        if log:
            log(f"organism: cached at {out}")
        return out
    if shipped.shipped_dir(key) and not rebuild:
        digest = shipped.install(key, out)
        if log:
            log(f"organism: installed the shipped weights of {key} (sha256 {digest[:12]}) -> {out}")
        return out
    shutil.rmtree(out, ignore_errors=True)  # a rebuild replaces the last one
    t0 = time.perf_counter()
    tokenizer, model, examples = warmup_inputs(cfg, full, held_out, split_digits, cache_dir)
    longest = max(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    if longest > cfg.max_positions:
        raise ValueError(f"build_organism: a warm-up sequence has {longest} tokens > max_positions="
                         f"{cfg.max_positions}; raise OrganismConfig.max_positions or vocab_size")
    n_params = sum(p.numel() for p in model.parameters())
    if log:
        log(f"organism: building {key}: {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}, "
            f"{len(examples)} warm-up examples on {len(corpus.problems) - len(held_out)} problems "
            f"({len(held_out)} held out) and {full.extra} warm-up-only ones, {cfg.steps} steps")
    threads = threads or auto_threads()
    if log:
        log(f"organism: warm-up on {threads} torch thread(s)")
    old_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        rows = seeded_warmup(cfg, model, examples, tokenizer.pad_token_id, log)
    finally:
        torch.set_num_threads(old_threads)
    meta = {"key": key, "config": dataclasses.asdict(cfg), "code": ORGANISM_CODE_VERSION,
            **({"split_digits": True} if split_digits else {}),
            "n_params": n_params, "vocab": len(tokenizer), "held_out": sorted(held_out),
            "n_extra": full.extra, "n_examples": len(examples), "threads": threads,
            "build_s": time.perf_counter() - t0,
            "warmup_log": rows}
    with atomic_dir(out) as tmp:  # a concurrent build that finished first wins
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta["files"] = dir_digests(tmp)  # checked whenever the entry is found (cache.entry_ok)
        (tmp / "organism.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    if log:
        log(f"organism: built in {meta['build_s']:.0f}s -> {out}")
        if (src := shipped.shipped_dir(key)) is not None:
            same = shipped.sha256(out / shipped.WEIGHTS) == shipped.read_manifest(src)[shipped.WEIGHTS]
            log("organism: the build equals the shipped weights, byte for byte" if same else
                "organism: the build differs from the shipped weights (expected on any machine but the one "
                "that built them: its CPU rounds matrix products differently; docs/reproducibility.md)")
    return out


def load_organism(path: str | os.PathLike) -> tuple[AutoModelForCausalLM, PreTrainedTokenizerFast, dict]:
    """(model in eval mode, tokenizer, organism.json contents) from a built organism directory."""
    path = pathlib.Path(path)
    meta_path = path / "organism.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} missing: {path} is not a built organism (run build_organism)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), json.loads(meta_path.read_text(encoding="utf-8"))
