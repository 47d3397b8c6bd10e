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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
