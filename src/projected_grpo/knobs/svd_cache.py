"""SVD cache: reduced SVDs of frozen weights on disk, keyed by a hash of W's bytes (dtype-safe).

The SVD knob needs U, S, Vh of every wrapped W; on a real model that is minutes of fp32 SVDs, so they
are cached under `store.cache_root() / "svd"` ($PROJECTED_GRPO_CACHE/svd, else ~/.cache/projected_grpo/svd).
A file is trusted only if its checksum, shapes, finiteness and U·S·Vh ≈ W all hold; anything else is a
warning and a recompute with an atomic rewrite, never a crash or a wrong W.
Not here: the knobs themselves (adapters.py).
"""

from __future__ import annotations

import hashlib
import pathlib
import warnings

import torch

from projected_grpo.errors import UserError
from projected_grpo.store import cache_root, load_tensors, save_tensors, weight_hash

SVD_FORMAT = "svd-v1"  # bump when the cached content changes meaning


def _tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().reshape(-1).view(torch.uint8).numpy())  # 1-D first (see above)
    return h.hexdigest()


def _load_svd(path: pathlib.Path, W: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Cached (U, S, Vh) if the file is intact and reconstructs W, else None after a warning."""
    try:
        t, meta = load_tensors(path)  # fresh aligned copies: see store.py
        d_out, d_in = W.shape
        R = min(d_out, d_in)
        U, S, Vh = t["U"], t["S"], t["Vh"]
        problem = None
        if meta.get("format") != SVD_FORMAT or meta.get("checksum") != _tensors_checksum(t):
            problem = "checksum/format mismatch"
        elif U.shape != (d_out, R) or S.shape != (R,) or Vh.shape != (R, d_in):
            problem = (f"shapes {tuple(U.shape)}, {tuple(S.shape)}, {tuple(Vh.shape)} "
                       f"do not fit W {tuple(W.shape)}")
        elif not all(torch.isfinite(x).all() for x in (U, S, Vh)):
            problem = "non-finite values"
        else:
            Wf = W.detach().float()
            W_rec = (U.to(Wf) * S.to(Wf)) @ Vh.to(Wf)
            err = torch.linalg.norm(W_rec - Wf) / torch.linalg.norm(Wf).clamp_min(1e-30)
            if err > 1e-3:
                problem = f"reconstruction error {err:.2e} (file is for another matrix)"
    except (UserError, OSError, KeyError, RuntimeError) as e:
        problem = f"unreadable ({type(e).__name__}: {e})"
    if problem is not None:
        warnings.warn(f"SVD cache file {path} is corrupt ({problem}); recomputing it", stacklevel=3)
        return None
    return U, S, Vh


def svd_cached(W: torch.Tensor, cache_dir: pathlib.Path | None, key: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Reduced SVD of W (d_out, d_in) in fp32 -> U (d_out, R), S (R,), Vh (R, d_in), status.

    status is "hit", "miss" or "corrupt" (a bad file is recomputed and rewritten, never trusted).
    cache_dir None means `store.cache_root() / "svd"`; key: `weight_hash(W)` if already computed.
    """
    path = (cache_dir or cache_root() / "svd") / f"{key or weight_hash(W)}.safetensors"
    status = "miss"
    if path.exists():
        got = _load_svd(path, W)
        if got is not None:
            return *got, "hit"
        status = "corrupt"
    U, S, Vh = torch.linalg.svd(W.detach().float(), full_matrices=False)
    t = {"U": U.cpu().contiguous(), "S": S.cpu().contiguous(), "Vh": Vh.cpu().contiguous()}
    save_tensors(path, t, {"format": SVD_FORMAT, "checksum": _tensors_checksum(t)})
    return U, S, Vh, status
