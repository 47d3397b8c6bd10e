"""What the project keeps on disk, in one place: atomic writes, tensor files, JSONL, hashes, the cache root.

Every file the project writes goes through `atomic_path` (a temp file in the target's directory, fsynced,
then `os.replace`), so a kill leaves the old file or the new one, never half of one. Every tensor read
from a safetensors file is copied into fresh memory (`load_tensors`): `safetensors` hands out views into
the file's mmap at 8-byte offsets, and on MKL's SSE4.2/AVX code paths (AMD and older Intel CPUs) a
matrix product's rounding depends on its operands' alignment, so a V_hack read from a checkpoint gave
other last bits than the same V computed in memory, and a resumed run drifted from an uninterrupted one
(docs/architecture.md). Hashes: `stable_hash` of JSON-able values, `weight_hash` of a tensor's
bytes, `tokenizer_fingerprint` of what encodes text. A write that fails (a full disk, a read-only
directory) raises an OSError that names the file it was writing. `DirLock`: one writer per directory
(`fcntl.flock`, released by the kernel when its process dies). Not here: what the files mean (their callers).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from projected_grpo.errors import UserError

# --- where -----------------------------------------------------------------------------------------


def cache_root(override: str | os.PathLike | None = None) -> pathlib.Path:
    """User cache directory: `override`, else $PROJECTED_GRPO_CACHE, else ~/.cache/projected_grpo."""
    if override:
        return pathlib.Path(override).expanduser()
    env = os.environ.get("PROJECTED_GRPO_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "projected_grpo"


# --- atomic writes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An OSError without a file name raised inside (a full disk fails `write` or `fsync` with ENOSPC and no
    name) is raised again naming `path`, so the CLI can print it as one line (cli.py)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from e


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[pathlib.Path]:
    """Yield a temp path beside `path`; on a clean exit it is fsynced and renamed over `path`, on an
    exception removed. The parent directory is created if missing. An OSError names `path`."""
    path = pathlib.Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
        os.close(fd)
        try:
            yield pathlib.Path(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Yield a fresh temp directory beside `path`; on a clean exit it is renamed to `path` (which must not
    exist or be empty), on an exception removed. A concurrent writer that finished first wins. An OSError
    names `path`."""
    path = pathlib.Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        try:
            yield tmp
            try:
                os.replace(tmp, path)
            except OSError:
                if not path.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: object) -> None:
    """Write `obj` as indented JSON atomically (NaN/inf refused: allow_nan=False)."""
    write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: list) -> None:
    """Write one JSON object per line atomically (NaN/inf refused)."""
    write_text_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None) -> None:
    """Write tensors (made contiguous CPU copies) as safetensors with `metadata`, atomically."""
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(tmp),
                  metadata=metadata)


# --- reads -----------------------------------------------------------------------------------------


def load_tensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; every tensor a fresh copy (64-byte aligned, not a view of
    the file: see the module docstring). Unreadable files raise UserError naming the file."""
    path = pathlib.Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: unreadable as safetensors ({type(e).__name__}: {e})") from e
    return tensors, meta


def _decode(raw: bytes, path: pathlib.Path, first_line: int = 1, error: type[Exception] = UserError) -> str:
    """UTF-8 text of `raw` (the bytes of `path` from line `first_line` on); a byte that is not UTF-8 raises
    `error` naming the file, line, column and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(f"{path}:{line}: not UTF-8 text: byte 0x{raw[e.start]:02x} at column {col} ({e.reason}); "
                    "save the file as UTF-8") from None


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A UTF-8 text file's contents: a missing file raises UserError naming it as `what`, a byte that is not
    UTF-8 raises UserError naming file, line and column."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such {what}")
    return _decode(path.read_bytes(), path)


def read_jsonl(path: str | os.PathLike, error: type[Exception] = UserError) -> Iterator[tuple[str, object]]:
    """Yield (where = "path:line", parsed object) per non-blank line; a bad line (invalid JSON, a byte that is
    not UTF-8) raises `error(where...)`.

    The one JSONL reader (pools, pairs, datasets, metrics), so a malformed line reads the same everywhere.
    A missing file raises UserError naming it."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    with path.open("rb") as f:  # bytes, decoded per line: a bad byte is reported with its line
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            line = _decode(raw, path, lineno, error)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno}): {line[:80]!r}") from None
            yield where, obj


# --- one writer per directory ------------------------------------------------------------------------


class Locked(Exception):
    """Another process holds the lock; `holder` is what it wrote in the lock file (pid and start time)."""

    def __init__(self, path: pathlib.Path, holder: str):
        super().__init__(f"{path} is held by {holder or 'another process'}")
        self.path, self.holder = path, holder


class DirLock:
    """An exclusive, non-blocking `fcntl.flock` on `path` (a lock file, created if missing, never removed:
    removing it would let a second process lock a new file while the first still holds the old one).

    The kernel releases a flock when the last descriptor of its open file closes: on `release()`, on exit,
    on a crash or SIGKILL, so a dead writer never leaves a stale lock. The descriptor is not inherited by
    exec'd children (Python opens files close-on-exec). The holder's pid and start time are written into the
    file, for the message the next process prints. Raises Locked when another process holds it."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        with naming(self.path):
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode("utf-8", "replace").strip()
            os.close(self._fd)
            self._fd = None
            raise Locked(self.path, holder) from None
        stamp = f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, stamp.encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock (closing the descriptor); a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- hashes and fingerprints -----------------------------------------------------------------------


def stable_hash(obj: object) -> str:
    """SHA-256 (first 16 hex digits) of `obj` as canonical JSON; raises TypeError on non-JSON values."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weight_hash(W: torch.Tensor) -> str:
    """sha256 of W's raw bytes + dtype + shape; byte view, so bf16 (no numpy dtype) hashes too."""
    h = hashlib.sha256(f"{W.dtype}|{tuple(W.shape)}|".encode())
    # flatten before the byte view: a contiguous tensor with a size-1 dim may keep a stride != 1
    h.update(W.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def dir_digests(path: str | os.PathLike) -> dict[str, str]:
    """name -> sha256 of every file directly in `path`: what a cache entry records about itself when written,
    so a later read can tell a whole entry from a damaged one (`digest_problem`)."""
    return {f.name: file_sha256(f) for f in sorted(pathlib.Path(path).iterdir()) if f.is_file()}


def digest_problem(path: str | os.PathLike, digests: dict[str, str]) -> str | None:
    """What differs from the recorded `digests` (dir_digests) in directory `path`: a missing file or one
    whose sha256 changed (truncated, a flipped byte); None when every recorded file is as written."""
    for name, digest in digests.items():
        f = pathlib.Path(path) / name
        if not f.is_file():
            return f"{name} is missing"
        if file_sha256(f) != digest:
            return f"{name} differs from the sha256 recorded when it was written"
    return None


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash (16 hex) of the tokenizer's vocabulary, merges, special tokens and chat template. Not of its
    padding / truncation state, which transformers rewrites on every call with those options."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
        body = json.dumps(spec, sort_keys=True)
    else:
        body = json.dumps(sorted(tokenizer.get_vocab().items()))
    blob = json.dumps([body, getattr(tokenizer, "chat_template", None) or "", tokenizer.eos_token_id])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
