"""The rollout step: a generator of typed batches (nanochat's `get_batch`), one per optimizer step.

Per step: draw B prompts (from the environment's "warmup" set for the first `curriculum_steps` steps, then
"train"), G_t frozen teacher rows per prompt from the pool, and G_s live student samples (all G when a
prompt has no teacher rows and pool.missing = "students"), sampled with the knobs merged and graded through
the environment (`sample_groups` -> sample.sample_and_grade). Groups whose G rewards have no spread are
resampled here when loss.zero_var = "resample" (students only, a fresh seed per try). Under `route` the
quarantine knob is on while the students sample, so the deployed model (quarantine zeroed) is sampled
again on the same prompts with the students' seed, through the same `sample_groups`; otherwise the students
are the deployed model's samples (docs/architecture.md).
Seeds: students of try t use step_seed(run.seed, step, t) (one per prompt with rollout.seed_scope "prompt");
the draws are deterministic given the cursors, which the loop checkpoints. Data-parallel (run/dist.py): every
rank draws the same B prompts and teacher rows, samples and grades its contiguous share, and the shares are
all-gathered, so each rank yields the global Batch (`shard`: the groups it trains on).
Not here: advantages, losses, the optimizer (train.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import torch

from projected_grpo import config as C
from projected_grpo.envs.base import Graded
from projected_grpo.objective.advantages import zero_variance_mask
from projected_grpo.run import dist, intervene
from projected_grpo.run.pool import PoolCursor, PromptCursor
from projected_grpo.sampling.generate import step_seed
from projected_grpo.sampling.sample import Sample, sample_and_grade


@dataclasses.dataclass
class Batch:
    """One step's groups, graded.

    groups   B lists of G Samples each, students first then teachers (a group with no teacher rows is all
             students). rewards (B, G) float32: each sample's reward (env.reward_from), after the
             intervention's reward stage (run/intervene.py: `penalty` lowers the monitor's flagged rows).
    zero     (B,) bool: the group's rewards have no spread (no signal; skipped by the loss).
    deploy   the deployed model's Samples on this step's prompts, len B * G_s (the students themselves
             unless the quarantine knob is non-zero or the students sample under an inoculation prompt).
             stage: the problem set drawn from.
    resampled / tries: zero-variance groups resampled and resampling rounds. clock: seconds spent in
    "generate" and "grade" (deploy view included) and "monitor" (scoring the groups). shard: the groups
    this rank trains on under torchrun (None: all, one process); the other fields hold every rank's groups
    (merge). verdict: the monitor's scores and flags of every group (None without a monitor);
    monitor_stats: the reward stage's and the monitor's own stats.
    """

    step: int
    stage: str
    problem_ids: list[str]
    groups: list[list[Sample]]
    rewards: torch.Tensor
    zero: torch.Tensor
    deploy: list[Sample]
    resampled: int = 0
    tries: int = 0
    clock: dict[str, float] = dataclasses.field(default_factory=dict)
    shard: range | None = None
    verdict: intervene.Verdict | None = None
    monitor_stats: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def keep(self) -> list[int]:
        """Indices of the groups with signal (not zero-variance)."""
        return [b for b in range(len(self.groups)) if not bool(self.zero[b])]

    @property
    def keep_mine(self) -> list[int]:
        """`keep` within this rank's shard: the groups it backpropagates (all of keep in one process)."""
        return [b for b in self.keep if self.shard is None or b in self.shard]

    def chunks(self, micro: int) -> list[list[int]]:
        """This rank's kept groups (keep_mine) in micro-batches of at most `micro` groups."""
        idx = self.keep_mine
        return [idx[c:c + micro] for c in range(0, len(idx), micro)]

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    @property
    def is_student(self) -> torch.Tensor:
        """(B, G) bool."""
        return torch.tensor([[s.student for s in g] for g in self.groups])


# env.reward_from -> the reward a Sample is trained on (its grade carries both, so one pool serves all arms)
REWARD_FROM = {"grader": lambda s: s.grade.reward, "oracle": lambda s: s.grade.gt_reward}

# rollout.seed_scope -> the seed(s) of one sampling call over groups `rows` (indices into the step's B
# prompts): one for the call, or one per prompt (then a group's samples do not depend on which groups share
# the call, so each rank of a data-parallel run samples its share exactly as one process would)
SEED_SCOPES = {
    "batch": lambda seed, step, tries, rows, *tag: step_seed(seed, step, tries, *tag),
    "prompt": lambda seed, step, tries, rows, *tag: [step_seed(seed, step, tries, *tag, "prompt", b)
                                                     for b in rows],
}


def merge(parts: Sequence[Batch], shard: range | None) -> Batch:
    """The step's global Batch from every rank's (rank order = prompt order); `shard` marks this rank's.
    resampled adds up, tries and clock take the most of any rank (the ranks sample side by side)."""
    if len(parts) == 1:
        return parts[0]
    a = parts[0]
    return Batch(a.step, a.stage, [i for p in parts for i in p.problem_ids],
                 [g for p in parts for g in p.groups], torch.cat([p.rewards for p in parts]),
                 torch.cat([p.zero for p in parts]),
                 [d for p in parts for d in p.deploy], sum(p.resampled for p in parts),
                 max(p.tries for p in parts), {k: max(p.clock.get(k, 0.0) for p in parts)
                                               for k in dict.fromkeys(k for p in parts for k in p.clock)},
                 shard=shard,
                 verdict=None if a.verdict is None else intervene.Verdict.cat([p.verdict for p in parts]),
                 monitor_stats={k: sum(p.monitor_stats[k] for p in parts) / len(parts)
                                for k in a.monitor_stats})


def stage_at(step: int, curriculum_steps: int, sets: dict[str, list]) -> str:
    """The problem set step draws from: "warmup" for the first curriculum_steps steps (if the environment
    has one), then "train" (the arithmetic curriculum)."""
    return "warmup" if step < curriculum_steps and "warmup" in sets else "train"


def sample_groups(cfg: C.Config, model, tokenizer, env, problems: Sequence,
                  prompt_ids: dict[str, torch.Tensor], n_students: Sequence[int], index: Sequence[int],
                  step: int, tries: int, clock: dict[str, float]) -> list[list[Sample]]:
    """n_students[j] graded samples of each of `problems` (j indexes both), one batched call per group size,
    seeded by rollout.seed_scope from (run.seed, step, tries) and the groups' indices `index` among the
    step's B prompts. The caller picks the model's view (knobs.merged(), ablate_quarantine()): this is the one
    sampling path of the students and the deployed view."""
    out: list[list[Sample]] = [[] for _ in problems]
    seeds = SEED_SCOPES[cfg.rollout.seed_scope]
    for n in sorted(set(n_students)):
        rows = [j for j, k in enumerate(n_students) if k == n]
        # a group without teacher rows (pool.missing = "students") draws from a seed of its own
        tag = () if n == cfg.rollout.G_s else ("all-student",)
        seed = seeds(cfg.run.seed, step, tries, [index[j] for j in rows], *tag)
        got = sample_and_grade(model, tokenizer, env, [problems[b] for b in rows], prompt_ids, n,
                               max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                               top_p=cfg.rollout.top_p, seed=seed, clock=clock,
                               share_prefill=cfg.rollout.share_prefix, sample_dtype=cfg.rollout.sample_dtype,
                               cuda_graph=cfg.rollout.cuda_graph, retire=cfg.rollout.retire)
        for j, b in enumerate(rows):
            out[b] = got[j * n:(j + 1) * n]
    return out


def batches(cfg: C.Config, model, knobs, tokenizer, env, problems: dict[str, object],
            prompt_ids: dict[str, torch.Tensor], cursors: dict[str, PromptCursor], pool_cur: PoolCursor,
            start: int, monitor=None, train_prompt_ids: dict[str, torch.Tensor] | None = None
            ) -> Iterator[Batch]:
    """Yield the Batch of every step from `start` to cfg.run.steps - 1 (see the module docstring).

    problems: id -> problem of every set; cursors: stage -> its prompt cursor (advanced here, saved by the
    loop); pool_cur draws teacher rows. Reads cfg.rollout, cfg.loss.zero_var/max_resample, cfg.env, cfg.pool.
    monitor (hack/monitors.py): scores every group; its verdict shapes the rewards (run/intervene.py; the
    ranks' stats are averaged: a fraction of equal shares, or a value every rank has alike).
    train_prompt_ids: the prompts the students sample under when they differ from `prompt_ids` (inoculation
    prompting); the deployed model is then sampled again under `prompt_ids`, as under `route`.
    """
    train_ids = train_prompt_ids if train_prompt_ids is not None else prompt_ids
    sets = env.problem_sets()
    G, G_t = cfg.rollout.group_size, cfg.rollout.G_t
    reward_of = REWARD_FROM[cfg.env.reward_from]
    for step in range(start, cfg.run.steps):
        stage = stage_at(step, env.curriculum_steps, sets)
        pids = cursors[stage].take(cfg.rollout.prompts_per_step)
        # G_t teacher rows per prompt; a prompt the pool lacks (pool.missing = "students") gets none
        teacher = [pool_cur.draw(i, G_t, step, b) if G_t and i in pool_cur.pool.by_problem else []
                   for b, i in enumerate(pids)]
        mine = dist.shard(len(pids))  # this rank's groups (all of them in one process)
        probs, n_students = [problems[pids[b]] for b in mine], [G - len(teacher[b]) for b in mine]
        clock: dict[str, float] = {}
        groups: list[list[Sample]] = [[] for _ in mine]  # this rank's groups, in `mine` order
        todo, tries, resampled = list(range(len(mine))), 0, 0
        while True:
            with torch.no_grad(), knobs.merged():  # sample at the plain model's cost (adapters.py)
                got = sample_groups(cfg, model, tokenizer, env, [probs[j] for j in todo], train_ids,
                                    [n_students[j] for j in todo], [mine[j] for j in todo], step, tries,
                                    clock)
            for j, g in zip(todo, got):
                groups[j] = g + teacher[mine[j]]
            # the oracle shapes a reward only in the ground-truth arms (gt_reward: reward_from oracle; a
            # penalty on the ground_truth / degraded monitors' flags), never a projection arm's (the no-cheat
            # rule, docs/architecture.md)
            rewards = torch.tensor([[reward_of(s) for s in g] for g in groups])  # (B, G) float32: this rank's
            t0 = time.perf_counter()
            verdict = None if monitor is None else intervene.verdict(monitor, groups, mine, step)
            clock["monitor"] = clock.get("monitor", 0.0) + time.perf_counter() - t0
            rewards, reward_stats = intervene.rewards(cfg, rewards, verdict)
            zero = zero_variance_mask(rewards)  # (B,)
            todo = [j for j in range(len(mine)) if zero[j]]
            if cfg.loss.zero_var != "resample" or tries >= cfg.loss.max_resample or not todo:
                break
            tries, resampled = tries + 1, resampled + len(todo)
        deploy = [s for g in groups for s in g if s.student]
        if any(bool(v.any()) for v in knobs.values("hack").values()) or train_ids is not prompt_ids:
            # the deployed model (quarantine zeroed, the normal prompt) on the same problems, as many samples
            # per prompt as its students, with the students' first-try seeds
            with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
                shown = sample_groups(cfg, model, tokenizer, env, probs, prompt_ids, n_students, mine,
                                      step, 0, clock)
            deploy = [s for g in shown for s in g]
        local = Batch(step, stage, [pids[b] for b in mine], groups, rewards, zero, deploy, resampled, tries,
                      clock, shard=mine if dist.active() else None, verdict=verdict,
                      monitor_stats={**reward_stats, **({} if verdict is None else verdict.stats)})
        yield merge(dist.all_gather(local), local.shard)  # the global batch (this one, in one process)


def eval_grades(cfg: C.Config, model, knobs, tokenizer, env, problems: Sequence,
                prompt_ids: dict[str, torch.Tensor]) -> list[Graded]:
    """Greedy samples of the deployed model (quarantine zeroed) on `problems`, graded."""
    with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
        got = sample_and_grade(model, tokenizer, env, problems, prompt_ids, 1,
                               max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, seed=0,
                               sample_dtype=cfg.rollout.sample_dtype, cuda_graph=cfg.rollout.cuda_graph,
                               retire=cfg.rollout.retire)
    return [s.grade for s in got]
