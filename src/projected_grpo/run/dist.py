"""Data-parallel training under `torchrun`: the process group, prompt shards, sums over ranks, rank 0 writes.

`init(device)` joins the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK): gloo on CPU, NCCL
on CUDA. Without torchrun, or with one process, every function here is a no-op and a run is exactly the
single-process run. Under it, each rank samples a contiguous share of the step's B prompts (`shard`), the
rollout step all-gathers the graded groups (`all_gather`), so advantages, zero-variance decisions and
every metric are computed over the global batch on each rank; each rank backpropagates its own groups and
`all_reduce_grads` sums the knob gradients and the per-source split over ranks BEFORE projection, so every
rank projects the same global gradient and the knobs stay identical. Sums are all-gathers added in rank
order (not all_reduce, whose association is the backend's): bitwise the same on every rank and run to
run; knob gradients are one R-vector per module, so this costs nothing. Only rank 0 writes (`is_main`).
Not here: which groups are sharded or what is summed (batches.py, train.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from projected_grpo import config as C
from projected_grpo.errors import UserError
from projected_grpo.knobs.split import Capture


def active() -> bool:
    """True inside a process group of more than one rank (torchrun --nproc_per_node > 1)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes metrics, checkpoints, the summary."""
    return rank() == 0


def init(cfg: C.Config) -> C.Config:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo for a CPU model.device, NCCL for CUDA, each
    rank on the GPU of its LOCAL_RANK); a no-op otherwise. Returns the config with rollout.seed_scope "auto"
    resolved: "prompt" under torchrun (each prompt's samples from its own seed, so the ranks sample what one
    process would), "batch" in one process. Checks first what data parallelism needs: B prompts that split
    evenly over the ranks, and per-prompt sampling seeds."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = C.resolve_auto(cfg)
    if world <= 1 or dist.is_initialized():
        return cfg
    device, B = cfg.model.device, cfg.rollout.prompts_per_step
    cuda = device.startswith("cuda")
    if cuda and device != "cuda":
        raise UserError(f"config: model.device={device!r} puts every rank on one GPU; under torchrun use "
                        "--model.device cuda (each rank takes the GPU of its LOCAL_RANK)")
    if B % world:
        raise UserError(f"config: rollout.prompts_per_step={B} does not split over {world} ranks: use a "
                        f"multiple of {world} (each rank samples B / world_size prompts)")
    if cfg.rollout.seed_scope != "prompt":
        raise UserError(f"config: rollout.seed_scope={cfg.rollout.seed_scope!r}: data-parallel training "
                        "draws each prompt's samples from its own seed; drop the flag (auto) or pass "
                        "--rollout.seed-scope prompt (one process with it trains the same run)")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    if is_main():
        print(f"data parallel: {world} ranks ({dist.get_backend()}), {B // world} prompts each per step",
              file=sys.stderr, flush=True)
    return cfg


def close() -> None:
    """Leave the process group (at the end of a run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard(n: int) -> range:
    """This rank's contiguous share of n items (all of them in one process): rank r gets [r n/W, (r+1) n/W),
    so the ranks' shares concatenated in rank order are the items in order."""
    w, r = world_size(), rank()
    if n % w:
        raise UserError(f"{n} prompts per step do not split over {w} ranks (rollout.prompts_per_step)")
    return range(r * n // w, (r + 1) * n // w)


def all_gather(obj: object) -> list:
    """[obj of rank 0, obj of rank 1, ...] (picklable objects); [obj] in one process."""
    if not active():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def from_main(obj: object) -> object:
    """Rank 0's obj on every rank (e.g. a run directory named by the clock)."""
    return all_gather(obj)[0]


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first, then the others (which then find what it wrote: caches, the pool)."""
    if active() and not is_main():
        dist.barrier()
    yield
    if active() and is_main():
        dist.barrier()


def sum_over_ranks(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]
                   ) -> list[torch.Tensor | None]:
    """Elementwise sums over ranks, added in rank order (the same bits on every rank). tensors[i] is this
    rank's value or None (e.g. a .grad no backward reached): None counts as zeros, and a result is None
    only where no rank had a value. like[i]: a tensor of tensors[i]'s shape, dtype and device."""
    if not active():
        return list(tensors)
    has = torch.tensor([t is not None for t in tensors], dtype=torch.float32, device=like[0].device)
    flat = torch.cat([(t if t is not None else torch.zeros_like(x)).detach().reshape(-1).to(torch.float32)
                      for t, x in zip(tensors, like)])
    flats, hass = [torch.empty_like(flat) for _ in range(world_size())], [torch.empty_like(has) for _ in
                                                                           range(world_size())]
    dist.all_gather(flats, flat)
    dist.all_gather(hass, has)
    total, present = flats[0].clone(), hass[0].clone()
    for f, h in zip(flats[1:], hass[1:]):
        total += f
        present += h
    out, at = [], 0
    for x, p in zip(like, present.tolist()):
        n = x.numel()
        out.append(total[at:at + n].reshape(x.shape).to(x.dtype) if p else None)
        at += n
    return out


def all_reduce_grads(knobs, split: Capture | None) -> Capture | None:
    """Sum every knob's .grad (main and quarantine) and the split's per-source g_student / g_teacher over
    ranks, in place on the knobs; returns the global split (None only when no rank ran a backward). Call
    after the backward, before projection: each rank then projects, clips and steps on the same gradient."""
    if not active():
        return split
    params = knobs.parameters() + knobs.hack_parameters()
    names = list(knobs.modules)
    vec = [knobs.modules[n].delta.detach().reshape(-1) for n in names]  # (R,): the split's shape per module
    mine = [p.grad for p in params] + [None if split is None else getattr(split, f).get(n)
                                       for f in ("g_student", "g_teacher") for n in names]
    summed = sum_over_ranks(mine, [p.detach() for p in params] + vec + vec)
    for p, g in zip(params, summed):
        p.grad = g
    g_s, g_t = summed[len(params):len(params) + len(names)], summed[len(params) + len(names):]
    if all(g is None for g in g_s + g_t):
        return None
    out = split if split is not None else Capture(torch.zeros(0, dtype=torch.bool))
    out.g_student = {n: g for n, g in zip(names, g_s) if g is not None}
    out.g_teacher = {n: g for n, g in zip(names, g_t) if g is not None}
    return out


def sum_stats(stats: dict[str, float]) -> dict[str, float]:
    """Per-key sums over ranks (keys any rank has), in rank order: for stats each rank already weighted by
    its share of the global batch (train.py's token-weighted means and step-level loss sums)."""
    if not active():
        return stats
    out: dict[str, float] = {}
    for part in all_gather(stats):
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def check_world_size(saved: int, where: object) -> None:
    """Refuse to resume a checkpoint written by another number of ranks."""
    if saved != world_size():
        raise UserError(f"--resume: {where} was written by {saved} rank(s), this run has {world_size()}: "
                        f"resume with the same world size (torchrun --nproc_per_node {saved})")
