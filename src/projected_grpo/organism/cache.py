"""The organism's cache entries are whole or built again: never a damaged one loaded, never a crash on one.

An organism directory records the sha256 of each of its files in organism.json when it is built
(store.dir_digests); `entry_ok` compares them whenever the entry is found (older entries, without the record,
must load), and a damaged entry (a deleted or truncated file, a flipped byte, bad JSON) is removed with a
warning naming it, so the caller builds it again, as the SVD and V_hack caches do (knobs/svd_cache.py,
hack/direction.py). `read_tokenizer` does the same for a cached tokenizer file. Not here: the cache keys and
the build (build.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import warnings
from collections.abc import Callable

from tokenizers import Tokenizer

from projected_grpo.store import digest_problem


def problem(path: pathlib.Path, load: Callable[[pathlib.Path], object]) -> str | None:
    """What is wrong with the organism directory `path`, or None when it is whole; load: build.load_organism,
    tried on entries built before organism.json recorded its files."""
    try:
        meta = json.loads((path / "organism.json").read_bytes().decode("utf-8"))
        if "files" in meta:
            return digest_problem(path, meta["files"])
        load(path)
    except Exception as e:  # whatever a damaged file raises (JSON, OSError, transformers' errors)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def entry_ok(path: pathlib.Path, load: Callable[[pathlib.Path], object]) -> bool:
    """True when the cached organism `path` exists and is whole; a damaged one is warned about and removed
    (moved aside first, so a concurrent reader never sees half of it) and False returned: build it again."""
    if not path.exists():
        return False
    if (why := problem(path, load)) is None:
        return True
    warnings.warn(f"organism cache {path} is corrupt ({why}); rebuilding it", stacklevel=3)
    aside = path.with_name(f".corrupt-{path.name}-{os.getpid()}")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return False


def read_tokenizer(path: pathlib.Path) -> Tokenizer | None:
    """The cached tokenizer at `path`, or None when absent or damaged (then a warning names it)."""
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_str(path.read_bytes().decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON; any failure: trained again
        warnings.warn(f"tokenizer cache file {path} is corrupt ({type(e).__name__}: {e}); rebuilding it",
                      stacklevel=3)
        return None
