"""Spawning a run's meshes and building every part the loop uses, from the resolved job.

    build_parts(plan)
        hosts:             plan.placement -> RunHosts (placement.py: this host, simulated hosts,
                           attached workers, Slurm, Kubernetes), every host up
        trainer mesh:      hosts.trainer.spawn_procs(ranks per host) -> PolicyTrainer per proc
                           -> MonarchTrainerClient (or spawn_trainer(...): the torchrun
                           ranks behind a TorchrunTrainerClient)
        generator meshes:  GeneratorPool: plan.generators[i] -> spawn_generator on
                           hosts.generator_host(i) (TP procs each), each one's weight transport,
                           the router over them, replacement of a lost one on its host
        generate_fn:       the pool's router (ResumingGenerateFn(router) with partial rollouts)
        rollout workers:   rollouter.num_workers > 0: RolloutWorkerPool.spawn on the generators'
                           hosts, each with its own router over the generators, mirrored from
                           the pool's router; a generator host lost takes its workers with it,
                           replaced on the hosts left (controller/rollout_workers/pool.py)
        task, tokenizer, cursor, rollouter, validator, metrics, recorder
    -> RunParts (controller/loop/loop.py)

Where the run's meshes are spawned (GeneratorPool spawns and replaces the generators).
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable
from typing import Any, Protocol

from torchtitan_rl.assets.tokenizer import load_tokenizer
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer
from torchtitan_rl.controller.fleet.generator_pool import GeneratorPool
from torchtitan_rl.controller.hosts.placement import RunHosts
from torchtitan_rl.controller.loop.data_cursor import DataCursor
from torchtitan_rl.controller.loop.loop import RunParts
from torchtitan_rl.controller.resolved_job import ResolvedJob
from torchtitan_rl.controller.rollout_workers.pool import RolloutWorkerPool
from torchtitan_rl.controller.rollout_workers.worker import RolloutWorkerSpec
from torchtitan_rl.controller.supervision import auto_health_poll_s
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.trainer import MonarchTrainerClient, PolicyTrainer, TrainerClient


class SpawnTrainer(Protocol):
    """Starts the trainer ranks in place of spawning a trainer mesh (a torchrun launch)."""

    async def __call__(self, config: PolicyTrainer.Config, model_dir: pathlib.Path, *,
                       batcher: Batcher.Config, verify_push: bool) -> TrainerClient: ...


def spawn_trainer_procs(plan: ResolvedJob, hosts: RunHosts, restart: int = 0) -> Any:
    """The trainer's procs on the placement's trainer hosts (``restart`` > 0: a new proc mesh
    for the trainer that replaces a lost one)."""
    per_host = plan.num_trainer_ranks // plan.placement.trainer_hosts
    name = f"trainer_r{restart}" if restart else None
    return hosts.trainer.spawn_procs(per_host={"procs": per_host}, name=name)


async def build_parts(plan: ResolvedJob, *, checkpointer: Checkpointer,
                      on_fatal: Callable[[str], None], resume_step: int | None = None,
                      spawn_trainer: SpawnTrainer | None = None) -> RunParts:
    """Spawn and build every part; ``checkpointer`` has prepared the run folder already,
    ``resume_step`` is the step a resumed run continues from (the weights the generators will be
    pushed), ``on_fatal`` fails the run (a generator that cannot be replaced)."""
    run_dir = pathlib.Path(plan.run_dir)
    model_dir = pathlib.Path(plan.model_dir)
    partial_rollouts = plan.loop.partial_rollout == "abort"
    # What can fail on bad input is built before any mesh exists (nothing to clean up then).
    task = plan.task.build()
    tokenizer = load_tokenizer(model_dir)
    rollouter = plan.rollouter.build(tokenizer=tokenizer, make_env=task.make_env)
    validator = plan.validation.build(rollouter=rollouter, dataset=task.dataset("validation"))
    cursor = DataCursor(num_prompts=len(task.dataset("train")), seed=plan.seed)
    trainer_procs = None
    pool: GeneratorPool | None = None
    workers: RolloutWorkerPool | None = None
    hosts = await plan.placement.build().open(len(plan.generators))
    host_poll_s = plan.placement.health_poll_s or auto_health_poll_s(len(plan.generators))
    hosts.watch_trainer_hosts(on_fatal, host_poll_s)
    if spawn_trainer is not None:
        trainer_spawn = asyncio.ensure_future(spawn_trainer(
            plan.trainer, model_dir, batcher=plan.batcher, verify_push=plan.verify_weight_push))
    else:
        trainer_procs = spawn_trainer_procs(plan, hosts)
        trainer_spawn = asyncio.ensure_future(MonarchTrainerClient.spawn(
            trainer_procs, plan.trainer, model_dir=model_dir, batcher=plan.batcher,
            verify_push=plan.verify_weight_push))
    try:
        # The trainer and the generators start at once: their start-ups (imports, model
        # builds, engines) are each one process's work, and the host has cores for both.
        pool = GeneratorPool(plan.generators, plan.router, hosts=hosts,
                             weight_transport=plan.trainer.weight_transport,
                             abort_on_pull=partial_rollouts, policy_version=resume_step or 0,
                             on_fatal=on_fatal,
                             host_poll_s=host_poll_s, run_dir=run_dir)
        generate_fn = await pool.spawn(trainer_spawn)
        trainer = trainer_spawn.result()
        if plan.rollouter.num_workers:
            assert pool.router is not None
            spec = RolloutWorkerSpec(task=plan.task, rollouter=plan.rollouter, router=plan.router,
                                     model_dir=str(model_dir), partial_rollouts=partial_rollouts)
            workers = await RolloutWorkerPool.spawn(
                spec, plan.rollouter.num_workers, generators=pool.handles, hosts=hosts,
                busy_clock=pool.router.busy_clock, on_fatal=on_fatal)
            pool.router.add_mirror(workers)
            pool.on_host_lost.append(workers.mark_host_lost)
    except BaseException:
        if workers is not None:
            await workers.close()
        if pool is not None:
            await pool.close()
        if not trainer_spawn.done():
            trainer_spawn.cancel()
        await asyncio.wait([trainer_spawn])
        if not trainer_spawn.cancelled() and trainer_spawn.exception() is None:
            await trainer_spawn.result().close()
        elif trainer_procs is not None:
            await trainer_procs.stop()
        await hosts.close()
        raise
    metrics = plan.metrics.build(run_dir=run_dir, purge_step=resume_step,
                                 run_config=checkpointer.job_config)
    if pool.router is not None:
        pool.router.trace = metrics.trace if metrics.trace.enabled else None
    return RunParts(
        task=task,
        tokenizer=tokenizer,
        cursor=cursor,
        rollouter=rollouter,
        group_size=plan.rollouter.group_size,
        sampling=plan.sampling,
        generate_fn=generate_fn,
        generators=pool,
        trainer=trainer,
        hosts=hosts,
        validator=validator,
        checkpointer=checkpointer,
        metrics=metrics,
        recorder=plan.recorder.build(run_dir=run_dir),
        workers=workers,
    )
