"""The synchronous GRPO loop: every step generates with the newest weights, then trains on it.

    for step in range(start, num_steps):
        P groups (ids next_group_id ..) -> Rollouter.run_group_rollouts x P, concurrently  [generate]
        groups -> TrainingSamples -> trainer.train_step (batch, fwd/bwd, optimizer)          [train]
        trainer -> generators: push weights, policy version = step + 1                      [sync]
        metrics, rollout JSONL, validation / checkpoint when due

Group g rolls out prompt ``cursor.prompt_index(g)`` with request seeds derived from g, so a resumed
run regenerates exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import logging
import time

from torchtitan_rl.controller.run_context import RunContext, StepRecord
from torchtitan_rl.rollout import rollout_group_to_training_samples, rollout_metrics
from torchtitan_rl.rollout.types import RolloutGroup

logger = logging.getLogger(__name__)


async def run_sync_loop(ctx: RunContext) -> None:
    cfg = ctx.config.loop
    while ctx.state.step < cfg.num_steps:
        step = ctx.state.step
        start = time.perf_counter()
        group_ids = range(ctx.state.next_group_id, ctx.state.next_group_id + cfg.prompts_per_step)
        ctx.state.next_group_id += cfg.prompts_per_step
        groups: list[RolloutGroup] = await asyncio.gather(*(
            ctx.rollouter.run_group_rollouts(
                ctx.generate_fn, ctx.train_prompt(g), g, ctx.config.rollouter.group_size, ctx.sampling
            )
            for g in group_ids
        ))
        generate_s = time.perf_counter() - start
        samples = [s for g in groups for s in rollout_group_to_training_samples(g)]
        metrics = rollout_metrics(groups)
        await ctx.train_and_publish(
            StepRecord(
                step=step,
                group_ids=list(group_ids),
                samples=samples,
                metrics=metrics,
                num_generated_tokens=sum(r.num_output_tokens for g in groups for r in g.rollouts),
                generate_s=generate_s,
                started_at=start,
            ),
            groups=groups,
        )
