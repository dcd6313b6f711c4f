"""Spawning a run's meshes and building every part the loop uses, from the resolved job.

    build_parts(plan)
        generator meshes:  plan.generators[i] -> spawn_generator (TP procs each) -> router
        trainer mesh:      this_host().spawn_procs(num_trainer_ranks) -> PolicyTrainer per proc
                           (or spawn_trainer_ranks(config, model_dir): the torchrun ranks)
        generate_fn:       BusyGenerateFn(ResumingGenerateFn(router) with partial rollouts)
        task, tokenizer, cursor, rollouter, validator, metrics, recorder
    -> RunParts (controller/parts.py)

The only module of the controller that touches Monarch's meshes directly.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Awaitable, Callable

from torchtitan_rl.controller.checkpointer import Checkpointer
from torchtitan_rl.controller.data_cursor import DataCursor
from torchtitan_rl.controller.idle_ratios import BusyGenerateFn
from torchtitan_rl.controller.parts import RunParts
from torchtitan_rl.controller.partial_rollout import ResumingGenerateFn
from torchtitan_rl.controller.resolved_job import ResolvedJob
from torchtitan_rl.controller.trainer_client import (
    MonarchTrainerRanks,
    TrainerClient,
    TrainerRanks,
)
from torchtitan_rl.generator import GeneratorHandle, spawn_generator
from torchtitan_rl.trainer.trainer import PolicyTrainer
from torchtitan_rl.types import GenerateFn

SpawnTrainerRanks = Callable[[PolicyTrainer.Config, pathlib.Path], Awaitable[TrainerRanks]]
"""(trainer config, model dir) -> the trainer ranks, in place of spawning a trainer mesh."""


async def build_parts(plan: ResolvedJob, *, checkpointer: Checkpointer,
                      resume_step: int | None = None,
                      spawn_trainer_ranks: SpawnTrainerRanks | None = None) -> RunParts:
    """Spawn and build every part; ``checkpointer`` has prepared the run folder already, and
    ``resume_step`` is the step a resumed run continues from."""
    from monarch.actor import this_host
    from transformers import AutoTokenizer

    run_dir = pathlib.Path(plan.run_dir)
    model_dir = pathlib.Path(plan.model_dir)
    generators: list[GeneratorHandle] = []
    ranks: TrainerRanks | None = None
    trainer_procs = None
    try:
        for index, generator_config in enumerate(plan.generators):
            generators.append(await spawn_generator(generator_config, name=f"generator_{index}"))
        router = plan.router.build(generators=generators)
        if spawn_trainer_ranks is not None:
            ranks = await spawn_trainer_ranks(plan.trainer, model_dir)
        else:
            trainer_procs = this_host().spawn_procs(per_host={"procs": plan.num_trainer_ranks})
            ranks = await MonarchTrainerRanks.spawn(trainer_procs, plan.trainer,
                                                    model_dir=model_dir)
    except BaseException:
        await asyncio.gather(*(g.close() for g in generators), return_exceptions=True)
        if ranks is not None:
            await ranks.close()
        elif trainer_procs is not None:
            await trainer_procs.stop()
        raise
    partial_rollouts = plan.loop.partial_rollout == "abort"
    trainer = TrainerClient(ranks, batcher=plan.batcher, generators=generators, router=router,
                            abort_on_pull=partial_rollouts, verify_push=plan.verify_weight_push)
    inner: GenerateFn = ResumingGenerateFn(router) if partial_rollouts else router
    task = plan.task.build()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollouter = plan.rollouter.build(tokenizer=tokenizer, make_env=task.make_env)
    return RunParts(
        task=task,
        tokenizer=tokenizer,
        cursor=DataCursor(num_prompts=len(task.dataset("train")), seed=plan.seed),
        rollouter=rollouter,
        group_size=plan.rollouter.group_size,
        sampling=plan.sampling,
        generate_fn=BusyGenerateFn(inner),
        router=router,
        generators=generators,
        trainer=trainer,
        validator=plan.validation.build(rollouter=rollouter, dataset=task.dataset("validation")),
        checkpointer=checkpointer,
        metrics=plan.metrics.build(run_dir=run_dir, purge_step=resume_step),
        recorder=plan.recorder.build(run_dir=run_dir),
    )
