"""The one exception for a user's mistake: `UserError`.

Raised where the program checks what a user gave it (a config value, a file, a dataset row, a checkpoint)
with a message that names the file, line or field and says what was expected. The CLI prints that
message alone and exits 2; every other exception is a bug and keeps its traceback. A subclass of
ValueError, so code that catches bad values keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A user's input is wrong; the message says where and what was expected."""
