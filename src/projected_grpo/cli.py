"""`projected-grpo` command line: one subcommand per pipeline stage, no logic here.

Each subcommand names the library function that implements it ("module:function"); that function
takes the remaining argv and parses it itself (with tyro), so `projected-grpo --help` stays fast
(nothing heavy is imported until a subcommand runs) and every option is documented where it is used.
An error whose cause is an input prints one line and exits 2: errors.UserError (a file, flag, model
directory, reward function or run directory that is not what was expected; the message names it), and an
OSError that names its file (missing, unreadable, permission denied, a full disk: store.py names the file a
failed write was writing). A command stopped by SIGTERM or Ctrl-C prints one line and exits 128 + the
signal's number. Anything else is a bug and keeps its traceback; `--debug` (anywhere) shows it always.
A command started by a sweep (study/launch.py sets PARENT_ENV) dies with the sweep: SIGTERM when it exits.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys

from projected_grpo.errors import Interrupted, UserError

PARENT_ENV = "PROJECTED_GRPO_PARENT_PID"  # set by study/launch.py for each run it starts

# name -> (one-line help, "module:function taking argv: list[str] and returning an exit code")
COMMANDS: dict[str, tuple[str, str]] = {  # pipeline order: the main job first
    "demo": ("make demo: none/erase/random_V/gt_reward, 1 seed (--arms all --seeds 3: all 8)",
             "projected_grpo.study.experiment:demo_main"),
    "experiment": ("sweep arms x seeds (or --lomo MODE); report + plot",
                   "projected_grpo.study.experiment:main"),
    "study": ("the whole study: every arm, control, LOMO fold; report",
              "projected_grpo.study.preregistered:main"),
    "arms": ("the arms table: role, labels needed at train time, what each changes, findings",
             "projected_grpo.study.arms:main"),
    "train": ("GRPO training run: --preset P --arm none|erase|route (--loss.algo ppo: PPO)",
              "projected_grpo.run.train:main"),
    "get-model": ("install + convert a named model once (smollm2), print its dir",
                  "projected_grpo.models:get_model_main"),
    "export": ("a run's checkpoint as a plain Hugging Face model dir",
               "projected_grpo.run.export:export_main"),
    "dpo": ("DPO of the knobs on (prompt, clean, hack) pairs, reference = knobs zeroed",
            "projected_grpo.run.dpo:main"),
    "build-organism": ("build or load the embedded organism, print checks",
                       "projected_grpo.organism.build_cli:main"),
    "build-maths-organism": ("build or load the maths organism, print its rates",
                             "projected_grpo.organism.maths:main"),
    "build-pool": ("build, grade once and freeze a teacher pool",
                   "projected_grpo.run.pool_cli:build_pool_main"),
    "extract-direction": ("extract V_hack, per-module hack directions",
                          "projected_grpo.run.direction_cli:main"),
    "separation": ("Tier 0, no RL: V_hack's, the direction monitor's and the probe's held-out separation "
                   "of hack from clean beside every control", "projected_grpo.run.separation:main"),
    "check-grader": ("self-check loophole graders + oracle",
                     "projected_grpo.envs.coding.selfcheck:check_grader"),
    "check-verifier": ("self-check the maths verifiers on a GSM8K file",
                       "projected_grpo.envs.maths.cli:check_verifier"),
    "grade-math": ("grade one maths response: strict + loophole (JSON)",
                   "projected_grpo.envs.maths.cli:grade_math"),
    "sandbox-run": ("run a .py file in the sandbox (JSON)",
                    "projected_grpo.envs.coding.sandbox:sandbox_run_cli"),
}


def _usage() -> str:
    width = max((len(n) for n in COMMANDS), default=0)
    lines = ["usage: projected-grpo COMMAND [options] [--debug]  (projected-grpo COMMAND --help: options)",
             "",
             "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (help_, _) in COMMANDS.items()]
    return "\n".join(lines)


def _one_line(e: BaseException) -> str | None:
    """The one line for an error whose cause is an input, or None for a bug (which keeps its traceback)."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, OSError) and e.filename is not None:  # the file is named: what it is and what failed
        code = f" [{errno.errorcode[e.errno]}]" if e.errno in errno.errorcode else ""
        other = f" -> {e.filename2}" if e.filename2 is not None else ""
        return f"{e.filename}{other}: {e.strerror or e}{code}"
    if isinstance(e, FileNotFoundError):  # raised by the project with the path in its message
        return str(e)
    return None


def _die_with_parent() -> None:
    """Under a sweep (PARENT_ENV set): SIGTERM this process when the sweep dies, even by SIGKILL, so no run
    trains on as an orphan (Linux prctl PR_SET_PDEATHSIG); a sweep already gone: exit now."""
    parent = os.environ.pop(PARENT_ENV, None)  # popped: what this process starts is not the sweep's run
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):  # it died before prctl: the signal will never come
        sys.exit(f"projected-grpo: the sweep that started this run (pid {parent}) has exited")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"projected-grpo: unknown command {name!r}; known: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    _die_with_parent()
    module, func = COMMANDS[name][1].split(":")
    fn = getattr(importlib.import_module(module), func)
    try:
        return int(fn(rest) or 0)
    except Interrupted as e:
        if debug:
            raise
        print(f"projected-grpo {name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"projected-grpo {name}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception as e:
        line = _one_line(e)
        if debug or line is None:
            raise
        print(f"projected-grpo {name}: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
