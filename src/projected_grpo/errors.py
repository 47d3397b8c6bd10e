"""The exceptions the CLI prints as one line: `UserError` and its kinds, and `Interrupted`.

`UserError` is raised where the program checks what a user gave it (a config value, a file, a dataset row, a
checkpoint, a model directory, a reward function, a run directory) with a message that names the file, line,
field or flag and says what was expected. The CLI prints that message alone and exits 2; every other
exception is a bug and keeps its traceback (and `--debug` shows one always). A subclass of ValueError, so
code that catches bad values keeps working. `Interrupted`: a command stopped by SIGTERM or Ctrl-C after
stopping what it started; its message says how to resume.
"""

from __future__ import annotations

import signal


class UserError(ValueError):
    """A user's input is wrong; the message says where and what was expected."""


class RunLocked(UserError):
    """Another process is writing the run directory (one writer per run: run/session.py)."""


class TrainingStalled(UserError):
    """The fail-closed check of run/session.py: the knobs did not move in a run's first informative steps.
    Its cause may be a setting (a zero learning rate) or a bug (a detached graph); the message names both."""


class Interrupted(Exception):
    """A command stopped by a signal once everything it started has stopped; exits 128 + the signal's number,
    as a shell reports a process killed by it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name
