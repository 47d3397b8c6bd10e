"""The report's figures: the hack / solve / well-formed curves per arm and the held-out eval curves.

Pure plotting of what report.py aggregated (arm -> metric -> (steps, Stat per step)): one line per arm,
a ± SEM band with >= 2 seeds, written atomically as PNG with an Agg canvas (no pyplot state).
Not here: reading runs and aggregating them (report.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from projected_grpo.store import atomic_path
from projected_grpo.study import verdicts as V
from projected_grpo.study.verdicts import Stat

LINESTYLES = ("-", "--", "-.", ":")  # arm i: colour C{i} and this dash, so equal curves stay visible
# (panel metric, y label) of the curves figure and of the held-out eval figure
PANELS: tuple[tuple[str, str], ...] = ((V.HACK, "hack rate, deployed (grader passes, oracle rejects)"),
                                       (V.SOLVE, "solve rate, deployed (oracle-correct)"),
                                       (V.FORMAT, "well-formed rate, deployed"))
EVAL_PANELS: tuple[tuple[str, str], ...] = (
    ("eval/accuracy", "held-out accuracy (greedy, deployed)"),
    ("eval/hack", "held-out hack rate (greedy, deployed)"))


def plot_curves(data: Mapping[str, Mapping[str, tuple[list[int], list[Stat]]]], path: str | os.PathLike,
                title: str, raw: Mapping[str, Mapping[str, tuple[list[int], list[Stat]]]] | None = None):
    """One panel per PANELS metric (hack, solve, well-formed rate vs step), one line per arm (seed mean of
    `data`, e.g. rolling means; ± SEM band with >= 2 seeds) over the faint seed mean of `raw` (the raw
    per-step rates) when given. Written atomically as PNG; returns the matplotlib Figure (no pyplot state,
    Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    for i, arm in enumerate(data):
        # colour and dash both vary, thinner lines on top, so arms with equal curves stay visible
        color, dash, width = f"C{i}", LINESTYLES[i % len(LINESTYLES)], max(1.0, 3.0 - 0.4 * i)
        for ax, (key, _) in zip(axes, PANELS):
            if raw is not None and key in raw.get(arm, {}):
                steps, stats = raw[arm][key]
                ax.plot(steps, [s.mean for s in stats], color=color, alpha=0.25, linewidth=0.8)
            steps, stats = data[arm][key]
            _line(ax, steps, stats, color=color, linestyle=dash, label=arm, linewidth=width)
    return _finish(fig, axes, PANELS, "optimizer step", data, title, path)


def _line(ax, xs: Sequence[int], stats: Sequence[Stat], **style) -> None:
    """One arm's seed-mean line, with a ± SEM band when every point has one (>= 2 seeds)."""
    mean = [s.mean for s in stats]
    ax.plot(xs, mean, **style)
    if stats and all(s.sem is not None for s in stats):
        lo, hi = [m - s.sem for m, s in zip(mean, stats)], [m + s.sem for m, s in zip(mean, stats)]
        ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.2, linewidth=0)


def _finish(fig, axes, panels: Sequence[tuple[str, str]], xlabel: str,
            data: Mapping[str, Mapping[str, tuple[list[int], list[Stat]]]], title: str,
            path: str | os.PathLike):
    """Axis labels and limits per panel, the legend, the title; the figure written atomically as PNG."""
    from matplotlib.ticker import MaxNLocator

    for ax, (_, label) in zip(axes, panels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    n_seeds = max((s.n for arm in data.values() for _, st in arm.values() for s in st), default=0)
    axes[0].legend(title="arm" + (" (mean ± SEM)" if n_seeds > 1 else ""), loc="best")
    fig.suptitle(title)
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return fig


def plot_eval_curves(data: Mapping[str, Mapping[str, tuple[list[int], list[Stat]]]], path: str | os.PathLike,
                     title: str, start: Stat | None = None, start_hack: Stat | None = None):
    """EVAL_PANELS against optimizer steps done (a row of step s is logged after s + 1 updates), one line per
    arm (seed mean; ± SEM band with >= 2 seeds), each line starting at `start` / `start_hack` (the starting
    model's eval, 0 steps done) when given. Written atomically as PNG; returns the Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(EVAL_PANELS))
    for i, arm in enumerate(data):
        color, dash, width = f"C{i}", LINESTYLES[i % len(LINESTYLES)], max(1.0, 3.0 - 0.4 * i)
        for ax, (key, _), first in zip(axes, EVAL_PANELS, (start, start_hack)):
            steps, stats = data[arm][key]
            xs, stats = [s + 1 for s in steps], list(stats)
            if first is not None:
                xs, stats = [0, *xs], [first, *stats]
            _line(ax, xs, stats, color=color, linestyle=dash, label=arm, linewidth=width, marker="o",
                  markersize=3)
    return _finish(fig, axes, EVAL_PANELS, "optimizer steps done (0 = the starting model)", data, title, path)
