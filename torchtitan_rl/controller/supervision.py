"""Actor procs that die: a lost generator is replaced, a lost trainer is restarted by the job
(job.py, from the newest checkpoint), anything else fails the run with one line.

    job: with MeshFailureWatch() as watch: build_parts(on_fatal=watch.fail)
         -> watch.attach(generator pool, rollout worker pool)
         -> await watch.run_until_failure(the run)
    a proc dies -> Monarch calls unhandled_fault_hook(failure) (on its own thread)
        -> the controller's event loop: _dispatch(mesh name, report)
           a generator's mesh            -> pool.mark_lost(i): replaced, the run goes on
           a rollout worker's mesh       -> workers.mark_lost(i): replaced, its groups restart
           a replaced one's mesh         -> ignored (late events of a mesh already gone; a
                                            replacement that fails to spawn fails the spawn)
           the trainer's mesh (watched)  -> the run is cancelled -> TrainerLostError: the job
                                            restarts the trainer (trainer.max_restarts)
           a replaced trainer's mesh     -> ignored
           Monarch's own meshes on a proc -> ignored (its logger, torch elastic set-up: they die
                                            with the proc, whose actor mesh reports the death)
           anything else                 -> the run is cancelled -> RunFailedError(summary)

How soon: Monarch checks every proc's health each ``placement.health_poll_s`` (apply_health_poll,
before the run's first mesh); each check costs the controller ~1-2 ms of CPU per generator.

Monarch's default hook exits the controller with a KeyboardInterrupt (no summary, no cleanup of
the other meshes). Waiting for the dead actor's calls to fail is not enough either: in the loop
(dozens of calls in flight) some calls to a SIGKILLed proc never resolved (monarch#3435), so the
watch acts on the hook itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


HEALTH_POLL_ENV = "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"
_poll_set_here: str | None = None
"""The value this process last put in the environment (any other value there is the user's)."""


MIN_PROMPT_HEALTH_POLL_S = 2.0
"""Below it Monarch 0.6 reports some lost procs only ~30 s after the kill: any one on workers
attached over TCP, and a second one lost from a shared proc mesh (4 tries of 5 at a 1 s poll; at
2 s, every one within the poll)."""


def auto_health_poll_s(num_generators: int) -> float:
    """N / 2 seconds for N generators, at least 2 (MIN_PROMPT_HEALTH_POLL_S) and at most 10
    (Monarch's own default): a check costs the controller ~1-2 ms of CPU per generator, so the
    generators' share of the poll stays about flat up to 20 of them, and a lost one among many is
    noticed within 10 s."""
    return min(10.0, max(MIN_PROMPT_HEALTH_POLL_S, num_generators / 2))


def apply_health_poll(seconds: float) -> str:
    """Monarch checks its procs every ``seconds`` from the next mesh spawned on (the procs spawned
    after this inherit it). ``HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY`` in the environment,
    unless this process set it, wins. Returns the value in force."""
    global _poll_set_here
    current = os.environ.get(HEALTH_POLL_ENV)
    if current is not None and current != _poll_set_here:
        logger.info("Monarch health checks every %s (%s in the environment)", current,
                    HEALTH_POLL_ENV)
        return current
    value = f"{max(1, round(seconds * 1000))}ms"
    os.environ[HEALTH_POLL_ENV] = _poll_set_here = value
    # Monarch reads its environment at import: make it read this one again.
    from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

    reload_config_from_env()
    logger.info("Monarch health checks every %s", value)
    return value


class RunFailedError(RuntimeError):
    """The run cannot go on (an actor proc died, a rollout group failed)."""


class TrainerLostError(RuntimeError):
    """A proc of the watched trainer mesh died: the job may restart the trainer."""


_COMPANION_MESHES = ("logger-", "spmdactor-")
"""Meshes Monarch spawns beside ours on the same procs (logging; setup_torch_elastic_env's
``_SPMDActor``, which Monarch names ``spmdactor-<id>``)."""


class ReplaceableMeshes:
    """A pool of actor meshes by index, each replaced on its own when lost: the generators
    (controller/fleet/generator_pool.py) and the rollout workers
    (controller/rollout_workers/pool.py). What the watch calls: ``index_of_mesh``, ``ignores``,
    ``mark_lost``.

    ``names[i]``: member i's spawn name (Monarch names its mesh ``<name>-<id>``). A lost member's
    name is retired at once; its replacement spawns as ``<prefix>_<i>_r<n>`` (a new name: late
    events of the dead mesh cannot match it) in a task of its own, one at a time per member, and
    takes the member's place once ``_replace`` returns True. A failure reported for a mesh still
    spawning is ignored: the spawn fails, and ``_replace`` decides what that means."""

    def __init__(self, prefix: str, count: int) -> None:
        self.prefix = prefix
        self.names = [f"{prefix}_{i}" for i in range(count)]
        self.retired_names: set[str] = set()
        self.spawning_names: set[str] = set()
        self.num_restarts = [0] * count
        """Replacements started, by member."""
        self.closing = False
        self._replacing: dict[int, asyncio.Task[None]] = {}

    def index_of_mesh(self, mesh_name: str) -> int | None:
        """The member whose actor mesh Monarch names ``mesh_name`` (``<spawn name>-<id>``)."""
        spawn_name = mesh_name.rsplit("-", 1)[0]
        return self.names.index(spawn_name) if spawn_name in self.names else None

    def ignores(self, mesh_name: str) -> bool:
        """A mesh replaced already (its late events change nothing), or a replacement still
        spawning (its failure fails the spawn)."""
        return mesh_name.rsplit("-", 1)[0] in self.retired_names | self.spawning_names

    def mark_lost(self, index: int, reason: str) -> None:
        raise NotImplementedError

    def replacing(self, index: int) -> bool:
        return index in self._replacing

    def start_replacement(self, index: int, reason: str) -> None:
        """Retire member ``index``'s name and replace it in a task of its own (not while one
        is under way, nor once the pool closes)."""
        if self.closing or index in self._replacing:
            return
        self.retired_names.add(self.names[index])
        self.num_restarts[index] += 1
        name = f"{self.prefix}_{index}_r{self.num_restarts[index]}"
        self._replacing[index] = asyncio.create_task(
            self._run_replacement(index, name, reason), name=f"replace-{self.prefix}-{index}")

    async def _run_replacement(self, index: int, name: str, reason: str) -> None:
        self.spawning_names.add(name)
        try:
            if await self._replace(index, name, reason):
                self.names[index] = name
        finally:
            self.spawning_names.discard(name)
            self._replacing.pop(index, None)

    async def _replace(self, index: int, name: str, reason: str) -> bool:
        """Spawn member ``index``'s replacement as ``name`` and put it in its place; False when
        it could not be (the pool has failed the run)."""
        raise NotImplementedError

    async def stop_replacing(self) -> None:
        """The pool closes: cancel the replacements under way and wait for them to unwind."""
        self.closing = True
        tasks = list(self._replacing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class MeshFailureWatch:
    """Handles actor mesh failures while active (a context manager; the hook is process-wide)."""

    def __init__(self, *, cancel_grace_s: float = 30.0) -> None:
        self.failures: list[str] = []
        """Fatal failures, first first."""
        self.pools: list[ReplaceableMeshes] = []
        self.cancel_grace_s = cancel_grace_s
        """How long a cancelled run may take to unwind before RunFailedError is raised anyway."""
        self.trainer_mesh: str | None = None
        """The spawn name of the trainer mesh whose loss raises TrainerLostError (None: a lost
        trainer fails the run)."""
        self.trainer_lost: str | None = None
        """The report of the watched trainer mesh's loss, until ``watch_trainer`` is called."""
        self._retired_trainer_meshes: set[str] = set()
        self._previous_hook: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: contextvars.Context | None = None
        self._failed = asyncio.Event()

    def __enter__(self) -> MeshFailureWatch:
        import monarch.actor

        self._loop = asyncio.get_running_loop()
        # Monarch calls the hook on its own thread, in its root client actor's context; what the
        # hook starts (a replacement's spawn) must run in the controller's, where this_host() is.
        self._context = contextvars.copy_context()
        self._previous_hook = monarch.actor.unhandled_fault_hook
        monarch.actor.unhandled_fault_hook = self._on_failure
        return self

    def __exit__(self, *exc: object) -> None:
        import monarch.actor

        monarch.actor.unhandled_fault_hook = self._previous_hook

    def attach(self, *pools: ReplaceableMeshes | None) -> None:
        """From now on a failure of a member of ``pools`` replaces it instead of failing the
        run (None: no such pool in this run)."""
        self.pools = [pool for pool in pools if pool is not None]

    def watch_trainer(self, mesh_name: str | None) -> None:
        """From now on the loss of trainer mesh ``mesh_name`` (its spawn name) raises
        TrainerLostError; events of the meshes watched before are ignored."""
        if self.trainer_mesh is not None:
            self._retired_trainer_meshes.add(self.trainer_mesh)
        self.trainer_mesh = mesh_name
        self.trainer_lost = None
        if not self.failures:
            self._failed.clear()

    def fail(self, message: str) -> None:
        """Fail the run (from the event loop's thread), e.g. a generator past max_restarts."""
        logger.error("actor mesh failure: %s", message)
        self.failures.append(message)
        self._failed.set()

    def _on_failure(self, failure: Any) -> None:
        report = re.sub(r"\s+", " ", str(failure.report())).strip()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, str(failure.mesh_name), report,
                                            context=self._context)

    def _dispatch(self, mesh_name: str, report: str) -> None:
        spawn_name = mesh_name.rsplit("-", 1)[0]  # Monarch names a mesh <spawn name>-<id>
        if mesh_name.startswith(_COMPANION_MESHES) or any(
                pool.ignores(mesh_name) for pool in self.pools) \
                or spawn_name in self._retired_trainer_meshes:
            logger.info("actor mesh failure (no action): %s", report)
            return
        if spawn_name == self.trainer_mesh:
            if self.trainer_lost is None:
                logger.warning("trainer lost: %s", report)
                self.trainer_lost = report
            self._failed.set()
            return
        for pool in self.pools:
            index = pool.index_of_mesh(mesh_name)
            if index is not None:
                pool.mark_lost(index, report)
                return
        self.fail(report)

    async def run_until_failure(self, work: Awaitable[T]) -> T:
        """Await ``work``; if an actor proc dies first, cancel it and raise RunFailedError."""
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=self.cancel_grace_s)
                if not task.done():
                    logger.warning("the run did not stop within %.0f s of being cancelled: %s",
                                   self.cancel_grace_s, task_stacks())
        if task.done() and not task.cancelled():
            return task.result()
        if self.trainer_lost is not None and not self.failures:
            raise TrainerLostError(self.trainer_lost)
        raise RunFailedError(self.summary())

    async def wait_for_failure(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until a failure of one of our meshes is reported: a call
        to a dead actor can fail before Monarch's supervision names the mesh that died."""
        try:
            await asyncio.wait_for(self._failed.wait(), timeout_s)
        except TimeoutError:
            pass

    def summary(self) -> str:
        """One line naming the first fatal failure of one of our actors (Monarch's own actors on
        the same proc, e.g. torch elastic set-up, report the same death less clearly)."""
        ours = [f for f in self.failures if "torchtitan_rl." in f or "was lost" in f]
        return f"actor mesh failure: {(ours or self.failures or ['unknown'])[0]}"


def task_stacks() -> str:
    """Where every task of the event loop waits (why a cancelled run does not stop)."""
    import io

    out = io.StringIO()
    for task in asyncio.all_tasks():
        task.print_stack(limit=12, file=out)
    return out.getvalue()
