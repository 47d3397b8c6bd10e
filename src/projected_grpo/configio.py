"""Reading a Config from JSON (a run's config.json, --config FILE): every field type-checked, every error
naming the file and the field; and the two field checks every section's __post_init__ uses. Kept apart
from config.py, which is the schema itself."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import typing

from projected_grpo.errors import UserError


def check_literals(obj: object) -> None:
    """Check every `Literal[...]` field of dataclass `obj` against its allowed values (one-line errors)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal and getattr(obj, f.name) not in typing.get_args(hint):
            raise UserError(f"config: {type(obj).__name__}.{f.name}={getattr(obj, f.name)!r} is not one of "
                             f"{list(typing.get_args(hint))}")


def check_positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    """Each named numeric field of dataclass `obj` is > 0 (>= 0 with allow_zero), else a one-line error."""
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            raise UserError(f"config: {type(obj).__name__}.{name}={value!r} must be "
                             f"{'>= 0' if allow_zero else '> 0'}")


def migrate(d: dict) -> dict:
    """A config dict as an earlier version wrote it (a run directory's config.json) in today's fields, so old
    runs still resume and report: run.tensorboard (bool) became run.report_to (["tensorboard"] or []). A dict
    holding both the old field and its replacement is left as it is (and fails as unknown)."""
    run = d.get("run")
    if not isinstance(run, dict) or "tensorboard" not in run or "report_to" in run:
        return d
    run = {k: v for k, v in run.items() if k != "tensorboard"}
    run["report_to"] = ["tensorboard"] if d["run"]["tensorboard"] else []
    return {**d, "run": run}


def config_from_dict(cls, d: dict, where: str = "config"):
    """`cls` (Config) from its `to_dict` form (or an earlier version's: `migrate`); unknown sections or fields
    fail naming them and `where`."""
    d = migrate(d)
    sections = {f.name: f.type for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = set(d) - set(sections)
    if unknown:
        raise UserError(f"{where}: unknown section(s) {sorted(unknown)}; known: {sorted(sections)}")
    kwargs = {}
    for name, sub in d.items():
        sec_cls = hints[name]
        sec_hints = typing.get_type_hints(sec_cls)
        bad = set(sub) - set(sec_hints)
        if bad:
            raise UserError(f"{where}: unknown field(s) {sorted(f'{name}.{b}' for b in bad)}; "
                            f"known: {sorted(sec_hints)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in sub.items()}
        for k, v in values.items():
            if not _fits(v, sec_hints[k]):
                raise UserError(f"{where}: {name}.{k}: expected {_type_name(sec_hints[k])}, got {v!r}")
        try:
            kwargs[name] = sec_cls(**values)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from e
    return cls(**kwargs)


def config_from_json(cls, path: str):
    """`cls` (Config) from a JSON file; bad JSON, unknown fields or wrong types fail naming file and field."""
    if not pathlib.Path(path).is_file():
        raise UserError(f"{path}: no such config file")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON: {e}") from e
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text ({e.reason}); save it as UTF-8") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object of sections, got {type(data).__name__}")
    return config_from_dict(cls, data, where=path)


def _fits(value: object, hint: object) -> bool:
    """Whether a JSON value fits a config field's type (int, float, str, bool, Literal, tuple)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    if hint is float:  # JSON writes 1.0 as 1
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: object) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint)
