"""A rollout worker: runs whole rollout groups in its own process, next to the generators; the
controller exchanges one message per group with it instead of one per turn.

    controller -spawn(RolloutWorkerSpec, [GeneratorRef])-> worker: task, tokenizer, Rollouter,
        one borrowed GeneratorHandle per generator (no procs: the pool owns the meshes; a
        generator out at the spawn comes without its mesh and starts taken out), its own
        GeneratorRouter over them (ResumingGenerateFn around it with partial rollouts)
    controller -run_groups([GroupAssignment], replies port)-> worker (one-way; the groups the
        controller assigned it in one event-loop turn): per group, task.dataset("train")[prompt
        index] -> Rollouter.run_group_rollouts (env steps, chat template, tokenizing; each turn
        GenerateRequest -submit-> generator -> Completion) -> GroupOutcome(packed
        TrainingSamples, the RolloutGroup) -> replies: the worker's finished groups in one
        message (at once when none is left running here, else within
        rollouter.worker_outcome_interval_s) -> controller
        (a generator lost under it: GroupOutcome.lost_reason; the controller raises
        GeneratorLostError and restarts the group whole; the group's own error: .error)
    controller router -set_in_push / take_out / put_back(GeneratorRef)-> every worker's router
        (RouterMirror, generator/router.py): pushes, losses and replacements route alike here
    controller -cancel_group(key)-> worker (the controller gave the group up: no outcome)
    controller -close()-> worker; then its proc is stopped

Invariants: a worker never stops or closes a generator (it only borrows handles); every request
seed comes from (seed, group, rollout, turn) as in the controller, so a group's tokens do not
depend on which worker ran it. Validation stays in the controller (controller/loop/validation.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
from typing import Any

from monarch.actor import Actor, Port, concurrent_endpoint

from torchtitan_rl import faults
from torchtitan_rl.assets.tokenizer import load_tokenizer
from torchtitan_rl.batched_calls import ReplyBatcher
from torchtitan_rl.console import configure_process_logging
from torchtitan_rl.generator import Generator, GeneratorHandle, GeneratorLostError
from torchtitan_rl.generator.partial_rollout import ResumingGenerateFn
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.rollout import rollout_group_to_training_samples
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.types import RolloutGroup
from torchtitan_rl.task import TaskConfig
from torchtitan_rl.types import GenerateFn, Sampling, TrainingSample

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutWorkerSpec:
    """What a worker builds its parts from (the resolved job's configs, plain data)."""

    task: TaskConfig
    rollouter: Rollouter.Config
    router: GeneratorRouter.Config
    model_dir: str
    """The tokenizer's HF directory (the generators' model)."""
    partial_rollouts: bool
    """loop.partial_rollout = "abort": requests aborted by a push are resumed."""


@dataclasses.dataclass(kw_only=True, slots=True)
class GeneratorRef:
    """A generator's actor mesh, as a worker borrows it (Monarch actor meshes pickle as refs)."""

    name: str
    actors: Any
    """None: the generator is out (lost, being replaced) as the worker is spawned; its stopped
    mesh cannot be handed, and put_back brings its replacement's."""
    config: Generator.Config

    @classmethod
    def of(cls, handle: GeneratorHandle) -> GeneratorRef:
        return cls(name=handle.name, actors=handle.actors, config=handle.config)


@dataclasses.dataclass(kw_only=True, slots=True)
class GroupAssignment:
    """A group the controller gives a worker: ``key`` names this call of it (a group id can be
    given again: restarted, or after a trainer restore), the rest says what to roll out."""

    key: int
    group_id: int
    prompt_index: int
    group_size: int
    sampling: Sampling
    attempt: int = 0


@dataclasses.dataclass(kw_only=True, slots=True)
class GroupOutcome:
    """A finished group as the controller needs it (plain data)."""

    key: int
    """The GroupAssignment's."""
    group_id: int
    group: RolloutGroup | None
    """None when the group lost its generator or failed."""
    samples: list[TrainingSample] = dataclasses.field(default_factory=list)
    """rollout_group_to_training_samples(group), packed here rather than in the controller."""
    lost_reason: str | None = None
    """Set when a generator serving the group was lost: the controller restarts it."""
    error: BaseException | None = None
    """The group's own error (an environment raised): the controller raises it."""
    num_routed: list[int] = dataclasses.field(default_factory=list)
    """Requests this worker has routed to each generator so far (cumulative, for the
    controller's router metrics)."""
    num_resumed: int = 0
    """Requests this worker has resumed after a pull aborted them so far (partial rollouts)."""


def _error_as_text(outcome: GroupOutcome) -> GroupOutcome:
    if outcome.error is None:
        return outcome
    return dataclasses.replace(outcome, error=RuntimeError(
        f"{type(outcome.error).__name__}: {outcome.error}"))


class RolloutWorker(Actor):
    def __init__(self, spec: RolloutWorkerSpec, generators: list[GeneratorRef],
                 first_of_pool: bool = False) -> None:
        """``first_of_pool``: worker 0 as first spawned (the fault point's target)."""
        configure_process_logging()
        self.first_of_pool = first_of_pool
        self.num_finished = 0
        self.spec = spec
        self.task = spec.task.build()
        self.episodes = self.task.dataset("train")
        tokenizer = load_tokenizer(spec.model_dir)
        self.rollouter = spec.rollouter.build(tokenizer=tokenizer, make_env=self.task.make_env)
        self.handles = [self._borrow(ref) for ref in generators]
        self.router: GeneratorRouter = spec.router.build(generators=list(self.handles))
        for index, ref in enumerate(generators):
            if ref.actors is None:  # out as this worker started: routed to once put back
                self.router.take_out(index)
                self.handles[index].detach("out when this rollout worker started")
        self.generate_fn: GenerateFn = (ResumingGenerateFn(self.router)
                                        if spec.partial_rollouts else self.router)
        gc.freeze()  # its start-up heap lives as long as it does: keep it out of collections
        self._groups: dict[int, asyncio.Task[RolloutGroup]] = {}
        """Groups rolling out here, by the controller's key for them."""
        self._replies: Port[list[GroupOutcome]] | None = None
        """The controller's reply port (one per worker: a replacement is a new worker)."""
        self._outcomes: ReplyBatcher[GroupOutcome] = ReplyBatcher(_error_as_text)

    def _borrow(self, ref: GeneratorRef) -> GeneratorHandle:
        return GeneratorHandle(procs=None, actors=ref.actors, config=ref.config, name=ref.name,
                               on_lost=self._on_handle_lost)

    def _on_handle_lost(self, handle: GeneratorHandle, reason: str) -> None:
        # Seen here first (a call failed with Monarch's supervision error): route around it
        # now; the controller's pool hears of the loss from Monarch and replaces the generator.
        if handle in self.handles:
            self.router.take_out(self.handles.index(handle))

    # ---- endpoints, in call order ---------------------------------------------------------------
    @concurrent_endpoint
    async def ready(self) -> int:
        """Built (a worker whose parts fail to build fails this call); its process id."""
        return os.getpid()

    @concurrent_endpoint
    async def run_groups(self, assignments: list[GroupAssignment],
                         replies: Port[list[GroupOutcome]]) -> None:
        """Each group rolled out, scored and packed as its own task; finished groups go to
        ``replies`` together (see _queue_outcome). A lost generator or the group's own error is
        an outcome, not an exception: the controller sends this one-way."""
        self._replies = replies
        tasks = []
        for assignment in assignments:
            task = asyncio.ensure_future(self._outcome_of(assignment))
            task.add_done_callback(self._queue_outcome)
            tasks.append(task)
        await asyncio.wait(tasks)

    async def _outcome_of(self, assignment: GroupAssignment) -> GroupOutcome | None:
        """None: the controller cancelled the group (it reads no outcome)."""
        key, group_id = assignment.key, assignment.group_id
        task = asyncio.ensure_future(self.rollouter.run_group_rollouts(
            self.generate_fn, self.episodes[assignment.prompt_index], group_id,
            assignment.group_size, assignment.sampling, attempt=assignment.attempt))
        self._groups[key] = task
        try:
            group = await task
        except GeneratorLostError as e:
            return self._outcome(key, group_id, None, lost_reason=str(e))
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this worker stops
            return None  # cancel_group
        except Exception as e:  # the task's own error (an env raised): the run fails with it
            return self._outcome(key, group_id, None, error=e)
        finally:
            if self._groups.get(key) is task:
                del self._groups[key]
        self.num_finished += 1
        faults.point("rollout_worker.group_finished", self.num_finished, key=self.first_of_pool)
        return self._outcome(key, group_id, group)

    def _outcome(self, key: int, group_id: int, group: RolloutGroup | None, *,
                 lost_reason: str | None = None, error: BaseException | None = None
                 ) -> GroupOutcome:
        samples = [] if group is None else rollout_group_to_training_samples(group)
        return GroupOutcome(key=key, group_id=group_id, group=group, samples=samples,
                            lost_reason=lost_reason, error=error,
                            num_routed=list(self.router.num_routed),
                            num_resumed=self._num_resumed())

    def _queue_outcome(self, task: asyncio.Task[GroupOutcome | None]) -> None:
        """Sent at once (end of this event-loop turn) when no other group runs here, else with
        whatever finishes within ``worker_outcome_interval_s``: one message for many groups."""
        outcome = None if task.cancelled() else task.result()
        if outcome is None:
            return
        assert self._replies is not None, "outcomes come only from run_groups"
        interval = self.spec.rollouter.worker_outcome_interval_s
        self._outcomes.add(self._replies, outcome, within_s=interval if self._groups else 0.0)

    def _num_resumed(self) -> int:
        fn = self.generate_fn
        return fn.num_resumed if isinstance(fn, ResumingGenerateFn) else 0

    @concurrent_endpoint
    async def cancel_group(self, key: int) -> None:
        """The controller gave the group sent under ``key`` up (the run stops, the trainer is
        restored): its requests are aborted (the handles abort cancelled requests)."""
        task = self._groups.pop(key, None)
        if task is not None:
            task.cancel()

    @concurrent_endpoint
    async def set_in_push(self, indices: list[int], in_push: bool) -> None:
        self.router.set_in_push(indices, in_push)

    @concurrent_endpoint
    async def take_out(self, index: int, reason: str) -> None:
        """Generator ``index`` was lost: its calls here fail with GeneratorLostError now
        (a call to a dead actor may never return, monarch#3435)."""
        self.router.take_out(index)
        self.handles[index].detach(f"was lost: {reason}")

    @concurrent_endpoint
    async def put_back(self, index: int, ref: GeneratorRef) -> None:
        """Generator ``index`` serves again (``ref``: its replacement's mesh)."""
        old = self.handles[index]
        if old.actors is not ref.actors:
            old.detach("replaced")
            self.handles[index] = self._borrow(ref)
        self.router.put_back(index, self.handles[index])

    @concurrent_endpoint
    async def close(self) -> None:
        """Cancel what runs and let go of the generators (never close them: the pool does)."""
        for task in self._groups.values():
            task.cancel()
        await asyncio.gather(*self._groups.values(), return_exceptions=True)
        for handle in self.handles:
            handle.detach("the rollout worker closed")
        aclose = getattr(self.task, "aclose", None)
        if aclose is not None:
            await aclose()

    def _handle_undeliverable_message(self, message: Any) -> bool:
        # A request to a generator that just died bounces; Monarch's default would fail this
        # worker for it. The controller's pool replaces the generator and tells us (put_back).
        logger.warning("undeliverable message (a lost generator?): %s", message.error_msg())
        return True
