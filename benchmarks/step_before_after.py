"""Training step time of two (or more) source trees on one preset, measured alternately in one session.

Each side is a `src` directory (a checkout's, e.g. an older commit's worktree) plus extra train flags
(`NAME=value` among them sets an environment variable of that side's runs instead); each run is
`python -m projected_grpo.cli train --preset P --model M --arm none` in a fresh subprocess with that `src`
first on PYTHONPATH, reading `time/step` (and `time/generate`, `time/backward`, `sample/kl` where the
tree logs it) from the run's metrics.jsonl. An untimed 1-step run per side first fills the shared cache
(SVDs, V_hack) so no timed run pays for a cold one. Then the sides alternate, the order flipped every
round (A B, B A, ...), so a change in the machine's load falls on all sides alike. Per side: the median
over every run's steps after its first (the first step includes one-off work: the first merge, allocator
growth). The speedup of a side is the first side's median step time over its own.

    PYTHONPATH=src .venv/bin/python benchmarks/step_before_after.py \
        --side old=../base/src --side "new=src" --side "new_bf16=src:--rollout.sample-dtype bfloat16" \
        [--side "new_keep=src:GLIBC_TUNABLES=glibc.malloc.trim_threshold=2147483648"] \
        [--preset smollm2-cpu] [--model smollm2] [--steps 4] [--rounds 2]

Last line: `RESULT <side>_step_s=<median> ... speedup_<side>=<first side / side> ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

KEYS = ("time/step", "time/generate", "time/backward", "sample/kl")
ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=")  # a side's `VAR=value` word: the environment, not a train flag


def parse_side(text: str) -> tuple[str, str, list[str]]:
    """'name=src[:flags]' -> (name, absolute src path, extra train flags and VAR=value environment words)."""
    name, eq, rest = text.partition("=")
    src, _, flags = rest.partition(":")
    if not eq or not name.isidentifier() or not (pathlib.Path(src) / "projected_grpo").is_dir():
        sys.exit(f"--side {text!r}: expected NAME=SRC[:FLAGS], NAME an identifier, SRC a directory holding "
                 "projected_grpo")
    return name, str(pathlib.Path(src).resolve()), shlex.split(flags)


def train(src: str, flags: list[str], base: list[str], run_dir: pathlib.Path, steps: int) -> dict:
    """One run: its metrics rows' KEYS (lists over steps), wall s, CPU s of the process tree, load at end."""
    words = [f for f in flags if ENV_WORD.match(f)]
    flags = [f for f in flags if f not in words]
    cmd = [sys.executable, "-m", "projected_grpo.cli", "train", *base, "--arm", "none", "--run.dir",
           str(run_dir), "--run.steps", str(steps), "--run.checkpoint-every", str(steps), *flags]
    env = dict(os.environ, PYTHONPATH=src, **dict(w.split("=", 1) for w in words))
    cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"train failed ({shlex.join(cmd)}, PYTHONPATH={src}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**{k: [r[k] for r in rows if k in r] for k in KEYS}, "wall": wall,
            "cpu": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", action="append", required=True, help="NAME=SRC[:FLAGS], repeated; the first "
                    "is the baseline the speedups divide")
    ap.add_argument("--preset", default="smollm2-cpu")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per side")
    opt = ap.parse_args()
    sides = [parse_side(s) for s in opt.side]
    if len(sides) < 2 or len({n for n, _, _ in sides}) < len(sides):
        sys.exit("--side: at least two, with distinct names")
    base = ["--preset", opt.preset, "--model", opt.model]
    runs: dict[str, list[dict]] = {n: [] for n, _, _ in sides}
    with tempfile.TemporaryDirectory(prefix="step_before_after-") as tmp:
        root = pathlib.Path(tmp)
        for name, src, flags in sides:
            w = train(src, flags, base, root / f"warm-{name}", 1)
            print(f"warm-up {name} (untimed: fills the cache): {w['wall']:.0f} s", file=sys.stderr)
        for r in range(opt.rounds):
            for name, src, flags in sides if r % 2 == 0 else sides[::-1]:
                out = runs[name]
                out.append(train(src, flags, base, root / f"{name}-{r}", opt.steps))
                print(f"round {r} {name}: steps {' '.join(f'{s:.2f}' for s in out[-1]['time/step'])} s, "
                      f"load {out[-1]['load']:.1f}", file=sys.stderr, flush=True)
    med = statistics.median
    print(f"preset {opt.preset}, model {opt.model}, arm none, {opt.steps} steps x {opt.rounds} runs per side "
          f"(first step of each run dropped), sides alternated; {os.cpu_count()} cores")
    print("| side | src | flags | step s (median) | steps s | generate s | backward s | sample/kl | "
          "CPU s/run | wall s/run | load |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    step = {}
    for name, src, flags in sides:
        rs = runs[name]
        per = {k: [x for r in rs for x in r[k][1:]] for k in KEYS}
        step[name] = med(per["time/step"])
        kl = f"{med(per['sample/kl']):.2e}" if per["sample/kl"] else "-"
        loads = " ".join(f"{r['load']:.1f}" for r in rs)
        print(f"| {name} | {src} | {shlex.join(flags) or '-'} | {step[name]:.2f} | "
              f"{' '.join(f'{s:.2f}' for s in per['time/step'])} | {med(per['time/generate']):.2f} | "
              f"{med(per['time/backward']):.2f} | {kl} | {med(r['cpu'] for r in rs):.0f} | "
              f"{med(r['wall'] for r in rs):.0f} | {loads} |")
    first = sides[0][0]
    print("RESULT " + " ".join(f"{n}_step_s={step[n]:.2f}" for n in step) + " "
          + " ".join(f"speedup_{n}={step[first] / step[n]:.2f}" for n in list(step)[1:]))


if __name__ == "__main__":
    main()
