"""organism/shipped.py: the package's organisms installed into the cache after a check of every file; a
rebuild compared with them; each preset's organism key is one the package ships.

Run: .venv/bin/pytest -q tests/test_organism_shipped.py
"""

from __future__ import annotations

import pytest

from projected_grpo.organism import build
from projected_grpo.organism.build import OrganismConfig, build_organism

TINY = OrganismConfig(vocab_size=400, hidden=16, layers=1, heads=2, max_positions=512, per_problem=4, steps=3,
                      batch_size=4, holdout_per_mode=1, renamed_per_problem=1, formula_problems=2,
                      per_extra=1)


def test_shipped_weights_install_check_and_rebuild(tmp_path, monkeypatch):
    from projected_grpo.organism import shipped

    monkeypatch.setattr(shipped, "SHIPPED", tmp_path / "pkg")
    logs: list[str] = []
    # one thread in both builds: "one machine" includes the thread count (docs/reproducibility.md)
    built = build_organism(TINY, cache_dir=tmp_path / "a", log=logs.append, threads=1)
    key = built.name
    dest = shipped.ship(built, key)  # the maintainers' step: files + SHA256SUMS in the package
    assert shipped.read_manifest(dest) == shipped.manifest(dest) and shipped.WEIGHTS in shipped.manifest(dest)
    # a fresh cache gets the shipped files, not a build: the same bytes, and a line that says so
    got = build_organism(TINY, cache_dir=tmp_path / "b", log=logs.append)
    assert got.name == key and "installed the shipped weights" in logs[-1]
    assert shipped.sha256(got / shipped.WEIGHTS) == shipped.sha256(built / shipped.WEIGHTS)
    # --rebuild trains anyway and compares: one machine, one process -> the same weights
    again = build_organism(TINY, cache_dir=tmp_path / "b", log=logs.append, rebuild=True, threads=1)
    assert again.name == f"{key}-rebuilt" and "equals the shipped weights" in logs[-1]
    # a damaged package is refused, naming the file (a rebuild would silently be another model)
    (dest / shipped.WEIGHTS).write_bytes(b"damaged")
    with pytest.raises(RuntimeError, match=r"\['model.safetensors'\] do not match"):
        build_organism(TINY, cache_dir=tmp_path / "c", log=None)


@pytest.mark.parametrize(("cores", "load", "want"), [
    (2, 0.3, 2),  # idle 2-core machine: both cores (round(0.3) = 0 busy)
    (2, 0.6, 1),  # round(0.6) = 1 core busy -> 2 - 1 = 1
    (2, 1.4, 1),  # 2 - round(1.4) = 1
    (2, 5.0, 1),  # 2 - 5 < 1 -> at least 1
    (8, 2.6, 5),  # 8 - round(2.6) = 8 - 3 = 5
])
def test_auto_threads_leaves_the_busy_cores_alone(monkeypatch, cores, load, want):
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(build.os, "getloadavg", lambda: (load, 0.0, 0.0), raising=False)
    assert build.auto_threads() == want


@pytest.mark.parametrize("preset", ["demo", "math-demo"])
def test_the_presets_organisms_are_the_shipped_ones(preset, tmp_path):
    # the key each preset asks for is one the package ships: a change to the organism code or config that
    # moves the key would silently drop the shipped weights (and every user would build another model)
    from projected_grpo import presets
    from projected_grpo.config import replace
    from projected_grpo.organism import shipped
    from projected_grpo.run import setup

    cfg = replace(presets.PRESETS[preset], model={"cache_dir": str(tmp_path)})
    path = setup.ORGANISMS[cfg.env.name](cfg)
    src = shipped.shipped_dir(path.name)
    assert src is not None, f"{preset}: organism key {path.name} is not shipped"
    assert shipped.sha256(path / shipped.WEIGHTS) == shipped.read_manifest(src)[shipped.WEIGHTS]
