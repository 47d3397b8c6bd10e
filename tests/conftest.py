"""Shared test setup: few threads (CI has 2 cores), GPU tests skip without CUDA, shared data path, and a
cache root of the session's own (tests never write to the user's ~/.cache/projected_grpo)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

torch.set_num_threads(1)

REPO = pathlib.Path(__file__).resolve().parents[1]
# $PROJECTED_GRPO_SHARED_DATA overrides it: a git worktree's parent is not the repo's parent
SHARED_DATA = pathlib.Path(os.environ.get("PROJECTED_GRPO_SHARED_DATA") or REPO.parent / "shared" / "data")


# the user's cache root as it is before the session's own replaces it: where `projected-grpo get-model` put
# the converted real models, read (never written) by the real-model tests
USER_CACHE = pathlib.Path(os.environ.get("PROJECTED_GRPO_CACHE")
                          or pathlib.Path.home() / ".cache" / "projected_grpo")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> pathlib.Path:
    """One cache root for the session's SmolLM2 runs (set as $PROJECTED_GRPO_CACHE): SmolLM2's SVDs, and
    V_hack where two runs' configs ask for the same one, computed by the first test that needs them and read
    by the rest (recomputing them was most of each test's time). None of the user's cache."""
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture
def smollm2_dir() -> pathlib.Path:
    """SmolLM2-135M-Instruct as `projected-grpo get-model smollm2` converted it into the user's cache (or
    converted now into the session's cache where the source package is installed); skips otherwise."""
    from projected_grpo import models
    from projected_grpo.errors import UserError

    converted = USER_CACHE / models.MODELS_DIR / "smollm2"
    if (converted / models.SOURCE_FILE).is_file():  # complete on its own; read only
        return converted
    try:
        return models.get_model("smollm2", install=False, log=lambda _: None)
    except UserError as e:
        pytest.skip(f"SmolLM2 not available ({e}); `projected-grpo get-model smollm2` installs it")


@pytest.fixture
def shared_data() -> pathlib.Path:
    """`../shared/data` beside the repo; tests that need it skip cleanly where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present (a user's clone has no ../shared)")
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    """PROJECTED_GRPO_CACHE for the whole session (subprocesses inherit it): SVDs, V_hack, organisms."""
    old = os.environ.get("PROJECTED_GRPO_CACHE")
    os.environ["PROJECTED_GRPO_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("PROJECTED_GRPO_CACHE", None)
    else:
        os.environ["PROJECTED_GRPO_CACHE"] = old
