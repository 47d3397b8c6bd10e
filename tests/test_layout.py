"""The file tree is the architecture: each layer imports only what docs/architecture.md's table allows,
no module imports run/train.py except the CLI, and no source file is over 400 lines (a test file 420).

Run: .venv/bin/pytest -q tests/test_layout.py
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "projected_grpo"

# layer -> the layers its modules may import (every import counts, lazy ones inside functions too).
# The floors, bottom-up (docs/architecture.md "Layers"): base modules; objective; knobs, envs; sampling;
# hack, organism; run; study; cli. A layer imports its own folder and the floors below it.
BASE = {"store", "errors"}
ALLOWED: dict[str, set[str]] = {
    "store": {"errors"}, "errors": set(), "stats": set(),
    "config": {"errors", "configio", "config_algos", "config_monitor", "config_run"},
    "config_run": {"errors", "configio"},
    "configio": {"errors"}, "config_algos": {"errors", "configio"},
    "config_monitor": {"errors", "configio"},
    "presets": {"config", "errors"}, "models": BASE,
    "objective": {"objective"},
    "knobs": {"knobs", "objective"} | BASE,
    "envs": {"envs"} | BASE,
    "sampling": {"sampling", "knobs", "objective", "envs"} | BASE,
    "hack": {"hack", "sampling", "knobs", "objective", "envs", "config", "stats"} | BASE,
    "organism": {"organism", "sampling", "envs", "objective"} | BASE,
    "run": {"run", "hack", "sampling", "knobs", "objective", "envs", "organism", "config", "presets",
            "models"} | BASE,
    "study": {"study", "run", "hack", "sampling", "envs", "config", "presets", "stats"} | BASE,
    "cli": {"errors"},
    "api": {"config", "presets", "errors", "envs", "run", "study"},
}


def _layer(module: str) -> str:
    return module.split(".")[0]


PACKAGES = {"", "run", "hack", "knobs", "study", "objective", "organism", "envs", "envs.coding", "envs.maths",
            "sampling"}


def _imports(path: pathlib.Path) -> list[str]:
    """Dotted names (after projected_grpo.) of every projected_grpo module `path` imports."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("projected_grpo"):
            base = node.module.removeprefix("projected_grpo").lstrip(".")
            # `from projected_grpo.run import setup` names a module; `from ...setup import x`, a name in one
            out += [f"{base}.{a.name}".lstrip(".") if base in PACKAGES else base for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name.removeprefix("projected_grpo.") for a in node.names
                    if a.name.startswith("projected_grpo.")]
    return out


def _allowed(imported: str, allowed: set[str]) -> bool:
    return any(imported == a or imported.startswith(a + ".") for a in allowed)


def test_layers_import_only_what_the_architecture_allows():
    bad = []
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        layer = _layer(module)
        if layer == "__init__":
            continue
        allowed = ALLOWED[layer]
        for imp in _imports(path):
            if not _allowed(imp, allowed):
                bad.append(f"{module} imports {imp}")
    assert bad == []


def test_the_allowed_table_has_no_cycle():
    # imports only point down: the table itself is a DAG (a layer may import its own folder), so no two
    # folders can ever be allowed to import each other
    graph = {layer: {_layer(a) for a in allowed} - {layer} for layer, allowed in ALLOWED.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert state.get(node) != 1, f"cycle: {' -> '.join((*path, node))}"
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in graph.get(node, ()):
            visit(nxt, (*path, node))
        state[node] = 2

    for layer in graph:
        visit(layer, ())


def test_no_two_folders_import_each_other():
    edges = set()
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        edges |= {(_layer(module), _layer(i)) for i in _imports(path) if _layer(i) != _layer(module)}
    assert sorted((a, b) for a, b in edges if (b, a) in edges) == []


def test_only_the_cli_reaches_the_training_loop():
    # run/train.py is the `train` command; everything else goes through the CLI (a run is a process), but for
    # the Python API's train(), the same entry point from Python
    users = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if any(i in ("run.train", "run.train.train", "run.train.LOOPS") for i in _imports(p))]
    assert users == ["api.py"]
    assert '"projected_grpo.run.train:main"' in (SRC / "cli.py").read_text()


def test_files_stay_near_400_lines():
    # the library's files at most 400 lines; test files a little over (a hand-computed case is long)
    limits = {**{p: 400 for p in SRC.rglob("*.py")}, **{p: 420 for p in SRC.parents[1].glob("tests/*.py")}}
    long = {str(p.relative_to(SRC.parents[1])): n for p, cap in limits.items()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > cap}
    assert long == {}
