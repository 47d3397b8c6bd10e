"""The embedded organisms as shipped with the package: the same model on every machine, in seconds.

A build is deterministic on one machine, but another CPU rounds its matrix products differently (BLAS), so
the same build elsewhere is another model, and no measured figure would be reproducible there even in
principle (docs/reproducibility.md). The package therefore carries the default organisms' weights and
tokenizers, built once on the machine named in `docs/organism.md`, under `organism/shipped/<key>/` with a
`SHA256SUMS` manifest. `build_organism` installs them into the cache when its key asks for them (the
shipped files are checked against the manifest first); `build-organism --rebuild` trains from scratch
and says whether the result equals the shipped weights (expected only on the machine that produced them).
"""

from __future__ import annotations

import pathlib
import shutil

from projected_grpo.store import atomic_dir, file_sha256

SHIPPED = pathlib.Path(__file__).resolve().parent / "shipped"
MANIFEST = "SHA256SUMS"
WEIGHTS = "model.safetensors"


sha256 = file_sha256  # hex sha256 of a file's bytes


def manifest(directory: pathlib.Path) -> dict[str, str]:
    """file name -> sha256 of every file in `directory` but the manifest itself."""
    return {p.name: sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


def read_manifest(directory: pathlib.Path) -> dict[str, str]:
    """The `SHA256SUMS` of a shipped organism (lines "<sha256>  <name>", sha256sum's format)."""
    lines = (directory / MANIFEST).read_text(encoding="utf-8").splitlines()
    return {name: digest for digest, _, name in (line.partition("  ") for line in lines if line.strip())}


def shipped_dir(key: str) -> pathlib.Path | None:
    """The shipped organism of cache key `key`, or None when the package carries none for it."""
    d = SHIPPED / key
    return d if (d / MANIFEST).is_file() else None


def install(key: str, out: pathlib.Path) -> str:
    """Copy the shipped organism `key` into the cache directory `out` (atomically), after checking every file
    against its manifest; returns the weights' sha256. A file that does not match raises: the package is
    damaged, and rebuilding would silently give another model (reinstall the package, or build with
    `build-organism --rebuild`)."""
    src = shipped_dir(key)
    if src is None:
        raise FileNotFoundError(f"no shipped organism for key {key}")
    want, have = read_manifest(src), manifest(src)
    if want != have:
        bad = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
        raise RuntimeError(f"shipped organism {src}: {bad} do not match {src / MANIFEST}; the package is "
                           "damaged: reinstall it, or build the organism with `build-organism --rebuild`")
    with atomic_dir(out) as tmp:
        for name in want:
            shutil.copyfile(src / name, tmp / name)
    return want[WEIGHTS]


def ship(built: pathlib.Path, key: str) -> pathlib.Path:
    """Copy a built organism directory into the package's shipped folder with its manifest (the
    maintainers' step: `build-organism --ship`); returns the shipped directory."""
    dest = SHIPPED / key
    shutil.rmtree(dest, ignore_errors=True)  # a maintainer's re-ship replaces the old files
    with atomic_dir(dest) as tmp:
        for p in sorted(built.iterdir()):
            if p.is_file() and p.name != "checks.json":
                shutil.copyfile(p, tmp / p.name)
        sums = "".join(f"{d}  {n}\n" for n, d in manifest(tmp).items())
        (tmp / MANIFEST).write_text(sums, encoding="utf-8")
    return dest
