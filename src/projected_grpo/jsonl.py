"""Reading JSONL files (pools, pairs, datasets, metrics) with errors that name the file and line.

One reader for every JSONL the project consumes, so a malformed line is reported the same way
everywhere: `path:line: invalid JSON (<why> at column c)`. Blank lines are skipped. Validation of the
objects themselves (fields, types) belongs to each caller, which gets the `where` string to cite.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator


def read_jsonl(path: str | os.PathLike, error: type[Exception] = ValueError) -> Iterator[tuple[str, object]]:
    """Yield (where = "path:line", parsed object) per non-blank line; a bad line raises `error(where...)`."""
    path = pathlib.Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno}): {line[:80]!r}") from None
            yield where, obj
