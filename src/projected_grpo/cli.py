"""`projected-grpo` command line: one subcommand per pipeline stage, no logic here.

Each subcommand names the library function that implements it ("module:function"); that function
takes the remaining argv and parses it itself (with tyro), so `projected-grpo --help` stays fast
(nothing heavy is imported until a subcommand runs) and every option is documented where it is used.
A user's mistake (errors.UserError, or a file that does not exist) prints its one-line message and exits
2; anything else is a bug and keeps its traceback. `--debug` (anywhere) shows the traceback always.
"""

from __future__ import annotations

import importlib
import sys

from projected_grpo.errors import UserError

# name -> (one-line help, "module:function taking argv: list[str] and returning an exit code")
COMMANDS: dict[str, tuple[str, str]] = {  # pipeline order: the main job first
    "demo": ("make demo: none/erase/route/random_V/gt_reward on the organism, report",
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
    module, func = COMMANDS[name][1].split(":")
    fn = getattr(importlib.import_module(module), func)
    try:
        return int(fn(rest) or 0)
    except (UserError, FileNotFoundError) as e:
        if debug:
            raise
        print(f"projected-grpo {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
