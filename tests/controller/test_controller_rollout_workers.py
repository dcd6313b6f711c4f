"""Rollout workers (rollouter.num_workers > 0).

Fast: the assignment of groups to workers, the router's mirrors, what the controller makes of a
worker's outcome (a lost generator is GeneratorLostError here; a cancelled call cancels the group
there), a replacement's start (the generators out handed without their meshes, the router's
changes while it started told once it is ready; the workers on a generator host lost for good
replaced on a host left), the agent-task refusal. Slow (real Monarch procs, vLLM, torchtitan): a job whose rollouts
run in two workers on a simulated generator host trains exactly the groups and losses of a job
without workers (S = 0, one seed); a generator killed mid-run with workers on is replaced and its
groups restart whole; a rollout worker killed mid-run is replaced and its groups restart whole;
partial rollouts in two workers over two generators keep the staleness
bound and resume every aborted request.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.controller.jobs import (
    REPO_ROOT,
    TINY_MODEL_BYTES,
    assert_every_group_trained_once,
    env_without_faults,
    read_hf_weights,
    read_metrics,
    run_killing_generator_0,
)
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.controller.rollout_workers.pool import (
    RolloutWorkerLostError,
    RolloutWorkerPool,
    WorkerAssigner,
)
from torchtitan_rl.controller.rollout_workers.worker import (
    GeneratorRef,
    GroupAssignment,
    GroupOutcome,
)
from torchtitan_rl.generator import GeneratorHandle, GeneratorLostError
from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.types import Sampling


# ---- fast: assignment ------------------------------------------------------------------------------
def test_assigner_gives_each_group_to_the_worker_with_fewest_in_flight():
    assigner = WorkerAssigner(3)
    assert [assigner.acquire() for _ in range(3)] == [0, 1, 2]  # equally busy: in turn
    assigner.release(1)
    assert assigner.acquire() == 1  # the only one with a free slot
    assigner.release(0)
    assigner.release(2)
    # 0 and 2 both idle, 0 given 1 group, 2 given 1: the lower index; then the other
    assert [assigner.acquire(), assigner.acquire()] == [0, 2]
    assert assigner.in_flight == [1, 1, 1] and assigner.num_assigned == [2, 2, 2]


def test_assigner_refuses_zero_workers():
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        WorkerAssigner(0)


# ---- fast: the router's mirrors ----------------------------------------------------------------------
class _Mirror:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def set_in_push(self, indices: list[int], in_push: bool) -> None:
        self.events.append(("in_push", indices, in_push))

    def take_out(self, index: int, reason: str) -> None:
        self.events.append(("out", index, reason))

    def put_back(self, index: int, generator) -> None:
        self.events.append(("back", index, generator))


class _LostGenerator:
    lost_reason = "SIGKILL"

    async def __call__(self, request):
        raise AssertionError("not routed to")


def test_the_router_tells_every_mirror_each_change_of_its_serving_set():
    lost, replacement = _LostGenerator(), _LostGenerator()
    router = GeneratorRouter.Config().build(generators=[lost, _LostGenerator()])
    mirrors = [_Mirror(), _Mirror()]
    for mirror in mirrors:
        router.add_mirror(mirror)
    router.set_in_push([0, 1], True)  # a relayed push: one message per mirror for both
    router.set_in_push([0, 1], False)
    router.take_out(0)
    router.put_back(0, replacement)
    for mirror in mirrors:
        assert mirror.events == [("in_push", [0, 1], True), ("in_push", [0, 1], False),
                                 ("out", 0, "SIGKILL"), ("back", 0, replacement)]


# ---- fast: the controller's side of a worker call ------------------------------------------------
class _Endpoint:
    def __init__(self, run=None) -> None:
        self.run = run
        self.broadcasts: list[tuple] = []

    def broadcast(self, *args) -> None:
        self.broadcasts.append(args)
        if self.run is not None:
            self.run(*args)


class _Channel:
    """A reply port and its receiver in this process (what Channel.open gives, without Monarch)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def send(self, batch) -> None:
        self.queue.put_nowait(batch)

    async def recv(self):
        return await self.queue.get()


def _open_channel():
    channel = _Channel()
    return channel, channel


class _Worker:
    """Each group it is given ends as ``reply(assignment)`` says, sent alone (or never)."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.assigned: list[GroupAssignment] = []
        self.run_groups = _Endpoint(self._run_groups)
        self.cancel_group = _Endpoint()

    def _run_groups(self, assignments, replies) -> None:
        for assignment in assignments:
            self.assigned.append(assignment)
            asyncio.ensure_future(self._one(assignment, replies))

    async def _one(self, assignment, replies) -> None:
        replies.send([await self.reply(assignment)])

    @property
    def group_ids(self) -> list[int]:
        return [a.group_id for a in self.assigned]


def _refs(num_generators: int) -> list[GeneratorRef]:
    """What a pool hands its workers, one per generator (a mesh stands in as any object)."""
    return [GeneratorRef(name=f"generator_{g}", actors=object(), config=None)
            for g in range(num_generators)]


def _pool(workers, num_generators: int, **kwargs) -> RolloutWorkerPool:
    return RolloutWorkerPool(workers, generators=_refs(num_generators),
                             open_channel=_open_channel, **kwargs)


def test_a_lost_outcome_is_generator_lost_and_a_cancelled_call_cancels_the_group_there():
    release = asyncio.Event()

    async def reply(a: GroupAssignment) -> GroupOutcome:
        if a.group_id == 7:
            await release.wait()
        return GroupOutcome(key=a.key, group_id=a.group_id, group=None,
                            lost_reason="generator_0 was lost", num_routed=[3])

    workers = [_Worker(reply), _Worker(reply)]
    pool = _pool([(None, w) for w in workers], num_generators=1)

    async def go() -> None:
        with pytest.raises(GeneratorLostError, match="generator_0 was lost"):
            await pool.run_group(1, 5, 4, Sampling(), attempt=0)
        waiting = asyncio.create_task(pool.run_group(7, 2, 4, Sampling(), attempt=1))
        while not workers[1].assigned:
            await asyncio.sleep(0)
        assert pool.assigner.in_flight == [0, 1]  # worker 0 had its turn already
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(asyncio.wait_for(go(), 10))
    first, = workers[0].assigned
    assert (first.group_id, first.prompt_index, first.attempt) == (1, 5, 0)
    sent, = workers[1].assigned
    assert workers[1].cancel_group.broadcasts == [(sent.key,)]  # it stops generating for it
    assert workers[0].cancel_group.broadcasts == []
    assert pool.assigner.in_flight == [0, 0] and pool.busy_clock.num_open == 0
    assert pool.metrics([2]) == {"router/generator_0/num_routed": 5.0,  # 2 here + 3 there
                                 "rollout/workers_replaced": 0.0,
                                 "rollout/worker_group_messages": 2.0,
                                 "rollout/worker_outcome_messages": 1.0}


def test_groups_assigned_in_one_loop_turn_leave_in_one_message_and_come_back_in_one():
    release = asyncio.Event()
    batches: list[list[GroupAssignment]] = []

    class _BatchingWorker(_Worker):
        def _run_groups(self, assignments, replies) -> None:
            batches.append(list(assignments))
            asyncio.ensure_future(self._all(assignments, replies))

        async def _all(self, assignments, replies) -> None:
            await release.wait()  # the worker sends its groups finished together as one batch
            replies.send([GroupOutcome(key=a.key, group_id=a.group_id, group=None)
                          if a.group_id != 2 else
                          GroupOutcome(key=a.key, group_id=2, group=None,
                                       error=ValueError("the env of group 2 raised"))
                          for a in assignments])

    worker = _BatchingWorker(None)
    pool = _pool([(None, worker)], num_generators=1)

    async def go() -> list:
        calls = [asyncio.ensure_future(pool.run_group(g, g, 4, Sampling())) for g in range(4)]
        late = asyncio.ensure_future(pool.run_group(9, 9, 4, Sampling()))
        calls[3].cancel()  # given up before it left: it never leaves
        while not batches:
            await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(*calls, late, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(go(), 10))
    assert [[a.group_id for a in batch] for batch in batches] == [[0, 1, 2, 9]]
    assert len({a.key for a in batches[0]}) == 4
    assert [r.group_id for r in (results[0], results[1], results[4])] == [0, 1, 9]
    assert isinstance(results[2], ValueError) and "group 2 raised" in str(results[2])
    assert isinstance(results[3], asyncio.CancelledError)
    assert worker.cancel_group.broadcasts == []
    assert pool.messages.num_sent == 1 and pool.messages.num_received == 1
    assert pool.assigner.in_flight == [0] and pool.busy_clock.num_open == 0


class _ReplaceableWorker(_Worker):
    def __init__(self, reply) -> None:
        super().__init__(reply)
        self.take_out = _Endpoint()
        self.put_back = _Endpoint()
        self.set_in_push = _Endpoint()


class _Procs:
    stopped = 0

    async def stop(self) -> None:
        self.stopped += 1


class _Actors:
    """A generator's actor mesh as a handle slices it."""

    def slice(self, **where) -> _Actors:
        return self


def _handle(name: str) -> GeneratorHandle:
    return GeneratorHandle(procs=None, actors=_Actors(), config=None, name=name)


def test_a_lost_worker_fails_its_groups_takes_none_and_its_replacement_learns_the_router():
    hang = asyncio.Event()  # never set: a SIGKILLed actor never replies

    async def never(a):
        await hang.wait()

    async def finish(a):
        return GroupOutcome(key=a.key, group_id=a.group_id, group=None, num_routed=[1, 0])

    lost_worker, other = _ReplaceableWorker(never), _ReplaceableWorker(finish)
    replacement = _ReplaceableWorker(finish)
    respawned: list[tuple[int, str, list[GeneratorRef]]] = []
    spawning, may_come_back = asyncio.Event(), asyncio.Event()

    async def respawn(index: int, name: str, handed: list[GeneratorRef]):
        respawned.append((index, name, handed))
        spawning.set()
        await may_come_back.wait()
        return _Procs(), replacement

    old_procs = _Procs()
    pool = _pool([(old_procs, lost_worker), (_Procs(), other)], num_generators=3,
                 respawn=respawn)
    serving = list(pool._generators)
    pool.take_out(1, "SIGKILL")  # generator 1 is out when the replacement starts (lost, or
    pool.take_out(2, "its host is gone")  # lost for good: never put back)
    pool.set_in_push([0], True)  # and generator 0 pulls weights
    generator_1_r1 = _handle("generator_1_r1")

    async def go() -> None:
        stuck = asyncio.create_task(pool.run_group(3, 0, 4, Sampling()))  # to worker 0
        while not lost_worker.assigned:
            await asyncio.sleep(0)
        assert pool.index_of_mesh("rollout_worker_0-a1b2") == 0
        pool.mark_lost(0, "SIGKILL")
        pool.mark_lost(0, "SIGKILL (the proc mesh's report)")  # once
        with pytest.raises(RolloutWorkerLostError, match="rollout worker 0 was lost: SIGKILL"):
            await stuck
        assert (await pool.run_group(4, 1, 4, Sampling())).group_id == 4  # worker 1 only
        await spawning.wait()
        pool.put_back(1, generator_1_r1)  # while the replacement starts: it is not told yet
        pool.take_out(0, "SIGKILL")
        may_come_back.set()
        while pool.assigner.down:
            await asyncio.sleep(0.01)
        assert (await pool.run_group(5, 2, 4, Sampling())).group_id == 5  # the replacement

    asyncio.run(asyncio.wait_for(go(), 10))
    (index, name, handed), = respawned
    assert (index, name) == (0, "rollout_worker_0_r1")
    # Generators out are handed without their (stopped) meshes: the worker starts them taken out.
    assert handed[0] is serving[0]
    assert [(ref.name, ref.actors) for ref in handed[1:]] == [("generator_1", None),
                                                              ("generator_2", None)]
    assert other.group_ids == [4]
    assert replacement.group_ids == [5]
    # What changed while it started, once it is ready: generator 1 back, 0 lost; 2 stays out.
    (back, ref), = replacement.put_back.broadcasts
    assert back == 1 and ref.name == "generator_1_r1" and ref.actors is generator_1_r1.actors
    assert replacement.take_out.broadcasts == [(0, "lost while this worker started")]
    assert replacement.set_in_push.broadcasts == [([0], True)]
    assert old_procs.stopped == 1
    assert pool.ignores("rollout_worker_0-a1b2") and not pool.ignores("rollout_worker_0_r1-c3")
    assert pool.index_of_mesh("rollout_worker_0_r1-c3") == 0
    assert pool.metrics([0, 0])["rollout/workers_replaced"] == 1.0


def test_a_worker_lost_before_any_group_is_replaced_and_serves():
    async def finish(a):
        return GroupOutcome(key=a.key, group_id=a.group_id, group=None, num_routed=[0])

    replacement = _ReplaceableWorker(finish)

    async def respawn(index: int, name: str, handed: list[GeneratorRef]):
        return _Procs(), replacement

    async def go() -> None:
        pool = _pool([(_Procs(), _ReplaceableWorker(finish))], num_generators=1,
                     respawn=respawn)
        pool.mark_lost(0, "SIGKILL")  # before any group: the pool has not waited yet
        await asyncio.gather(*pool._replacing.values())  # the replacement is in before the group
        assert (await pool.run_group(1, 0, 4, Sampling())).group_id == 1

    asyncio.run(asyncio.wait_for(go(), 10))
    assert replacement.group_ids == [1]


class _Ready:
    async def call_one(self) -> int:
        return 4321  # the worker's pid


class _WorkerHost:
    """A generator host: the names of the proc meshes spawned on it, each with a worker."""

    def __init__(self) -> None:
        self.spawned: list[str] = []
        self.handed: list[list[GeneratorRef]] = []
        self.stopped = 0

    def spawn_procs(self, per_host: dict[str, int], name: str) -> _WorkerHost:
        self.spawned.append(name)
        return self

    def spawn(self, name: str, cls, spec, handed: list[GeneratorRef], first_of_pool: bool):
        self.handed.append(handed)
        worker = _ReplaceableWorker(None)
        worker.ready = _Ready()
        return worker

    async def stop(self) -> None:
        self.stopped += 1


class _Hosts:
    """Two machines with worker addresses (no proc mesh shared over them)."""

    generator_workers = ["tcp://node1:26600", "tcp://node2:26600"]
    separate_machines = False

    def __init__(self) -> None:
        self.hosts = [_WorkerHost(), _WorkerHost()]

    def generator_host_index(self, index: int) -> int:
        return index

    def generator_host(self, index: int) -> _WorkerHost:
        return self.hosts[index]


def test_the_workers_on_a_generator_host_lost_for_good_are_replaced_on_a_host_left():
    """Host 1 gone whole (the generator pool's host watch: generator 1 lost with it, never put
    back): worker 1, which lived there, is lost with it (Monarch may never report it), nothing
    is stopped there, and its replacement is spawned on generator 0's host, handed generator 1
    without its mesh; a worker lost later is replaced on host 0 again."""
    hosts = _Hosts()
    generators = [_handle("generator_0"), _handle("generator_1")]

    async def go() -> RolloutWorkerPool:
        pool = await RolloutWorkerPool.spawn(None, 2, generators=generators, hosts=hosts)
        pool.take_out(1, "its host is gone")  # the router's mirror, told first
        pool.mark_host_lost(1, "its worker stopped answering")
        assert pool.assigner.down == {1}  # its groups restart on worker 0
        await asyncio.gather(*pool._replacing.values())
        pool.mark_lost(1, "SIGKILL")  # the replacement lost in turn
        await asyncio.gather(*pool._replacing.values())
        return pool

    pool = asyncio.run(asyncio.wait_for(go(), 10))
    assert hosts.hosts[0].spawned == ["rollout_worker_0", "rollout_worker_1_r1",
                                      "rollout_worker_1_r2"]
    assert hosts.hosts[1].spawned == ["rollout_worker_1"]
    assert hosts.hosts[1].stopped == 0 and hosts.hosts[0].stopped == 1  # rollout_worker_1_r1
    first, handed, _ = hosts.hosts[0].handed
    assert [ref.actors for ref in first] == [g.actors for g in generators]
    assert [ref.actors for ref in handed] == [generators[0].actors, None]
    assert pool.names[1] == "rollout_worker_1_r2" and not pool.assigner.down
    assert pool.worker_hosts == [0, 0]
    replacement = pool.workers[1][1]
    assert replacement.take_out.broadcasts == [] and replacement.put_back.broadcasts == []


def test_an_agent_task_with_workers_needs_a_free_port_each_naming_the_key(tiny_model_dir):
    args = ["--model.size", "tiny", "--task.type", "torchtitan_rl.rollout.agent_task:AgentTask",
            "--task.agent", "tests.controller.letter_agent:run",
            "--task.episodes.type", "tests.controller.letter_task:LetterTask",
            "--rollouter.num_workers", "2"]
    RLJob(parse_args(RLJob.Config, args).config).resolve()  # task.port = 0: one port each
    config = parse_args(RLJob.Config, [*args, "--task.port", "8000"]).config
    with pytest.raises(ConfigError, match=r"^rollouter.num_workers=2: each rollout worker serves "
                                          r"its own agent endpoint, on a free port: task.port "
                                          r"must be 0, got 8000$"):
        RLJob(config).resolve()


# ---- slow: whole jobs ---------------------------------------------------------------------------
def _run_job(out: pathlib.Path, name: str, *args: str) -> pathlib.Path:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.controller.run_tiny_job", str(out), name, "3", *args],
        cwd=REPO_ROOT, env=env_without_faults(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / name


def _trained(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in
            (run_dir / "trained_samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_workers_on_a_simulated_host_train_the_groups_and_losses_of_a_job_without(
        tmp_path, sync_tiny_run):
    """Also the placement's check: a job over simulated hosts trains as on one host."""
    without, _ = sync_tiny_run  # the same 3-step tiny job on one host, rollouts in the controller
    # Outcomes held until a worker has no group left running: one message each way per worker
    # and step (S = 0 gives all of a step's groups in one event-loop turn).
    with_workers = _run_job(tmp_path, "workers", "--placement", "process", "--num-workers", "2",
                            "--worker-outcome-interval-s", "1e9")
    # S = 0 and one seed: which host or process runs a rollout must change nothing but the wires.
    assert _trained(with_workers) == _trained(without)
    expected, got = read_metrics(without), read_metrics(with_workers)
    messages = [(got[step]["rollout/worker_group_messages"],
                 got[step]["rollout/worker_outcome_messages"]) for step in range(3)]
    assert messages == [(2.0, 2.0), (4.0, 4.0), (6.0, 6.0)]
    for step in range(3):
        for key in ("loss/value", "trainer/grad_norm", "rollout_reward/mean",
                    "loss/num_valid_tokens", "router/generator_0/num_routed"):
            assert got[step][key] == expected[step][key], (step, key)
        assert got[step]["async/policy_age_max"] == 0
        # One shared-memory copy on one host; a message to the generator's host on simulated ones.
        assert expected[step]["weight_sync/generators_by_shared_memory"] == 1
        assert got[step]["weight_sync/generators_by_shared_memory"] == 0
        assert got[step]["weight_sync/bytes_moved"] == TINY_MODEL_BYTES
    # Two runs of one seed: the same final weights, bit for bit.
    final_without, final_with = read_hf_weights(without / "hf"), read_hf_weights(with_workers / "hf")
    assert final_without.keys() == final_with.keys()
    for name in final_without:
        assert torch.equal(final_without[name], final_with[name]), name
        assert got[step]["rollout/controller_cpu_ms_per_turn"] > 0


@pytest.mark.slow
def test_a_generator_killed_with_workers_on_is_replaced_and_its_groups_restart(tmp_path):
    num_steps, num_prompts = 5, 10
    returncode, stdout, log = run_killing_generator_0(
        tmp_path, "lost", num_steps, "--num-prompts", str(num_prompts), "--num-workers", "1",
        "--engine", "stand_in")
    assert returncode == 0, log[-4000:]
    assert f"steps={num_steps}" in stdout.strip().splitlines()[-1].split()
    run_dir = tmp_path / "lost"
    assert_every_group_trained_once(run_dir, num_steps, num_prompts)
    last = read_metrics(run_dir)[num_steps - 1]
    assert last["generator/restarts"] == 1
    assert "generator_0 replaced by generator_0_r1" in log
    # The kill lands while step 2's groups generate in the worker (admitted when step 1's
    # weights were published): those with a request on the dead generator restarted whole.
    restarts = last["generator/groups_restarted_after_loss"]
    assert restarts == log.count("restarts from its prompt") >= 1, log[-4000:]


def _run_killing_rollout_worker_0(tmp_path, num_steps: int, num_prompts: int,
                                  *args: str) -> subprocess.CompletedProcess:
    """A stand-in job (S = 1) whose rollout worker 0 SIGKILLs itself after its second group."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.controller.run_tiny_job", str(tmp_path), "lost_worker",
         str(num_steps), "--num-prompts", str(num_prompts), "--staleness", "1",
         "--engine", "stand_in", *args],
        cwd=REPO_ROOT, env=env_without_faults("kill_rollout_worker_after_groups:2"),
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"steps={num_steps}" in proc.stdout.strip().splitlines()[-1].split()
    run_dir = tmp_path / "lost_worker"
    # The group the worker died under (finished there, never replied) restarted whole, and so
    # did any other it held: every group trained exactly once.
    assert_every_group_trained_once(run_dir, num_steps, num_prompts)
    log = proc.stderr
    assert "fault injection: SIGKILL at kill_rollout_worker_after_groups=2" in log
    assert "rollout worker 0 lost: " in log, log[-4000:]
    assert read_metrics(run_dir)[num_steps - 1]["generator/groups_restarted_after_loss"] >= 1
    return proc


@pytest.mark.slow
def test_a_rollout_worker_killed_mid_run_has_its_groups_restart(tmp_path):
    # One worker: after the kill no group can run until its replacement serves them. (Two
    # sharing one proc mesh: the next test's run.)
    proc = _run_killing_rollout_worker_0(tmp_path, 4, 8, "--num-workers", "1")
    assert "rollout_workers: one proc mesh for" not in proc.stderr
    assert "rollout worker 0 replaced (rollout_worker_0_r1)" in proc.stderr, proc.stderr[-4000:]
    assert read_metrics(tmp_path / "lost_worker")[3]["rollout/workers_replaced"] == 1


@pytest.mark.slow
def test_partial_rollouts_in_workers_over_two_generators_stay_within_staleness(tmp_path):
    """Also a rollout worker killed mid-run when two share one proc mesh (shared_procs.py):
    worker 0's proc dies alone, worker 1 runs the restarted groups (the run may end before
    worker 0's replacement serves)."""
    num_steps = 4
    proc = _run_killing_rollout_worker_0(
        tmp_path, num_steps, 8, "--partial-rollout", "abort", "--num-generators", "2",
        "--num-workers", "2")
    assert "rollout_workers: one proc mesh for 2 on 1 host(s)" in proc.stderr
    metrics = {step: m for step, m in read_metrics(tmp_path / "lost_worker").items()
               if "loss/value" in m}
    assert sorted(metrics) == list(range(num_steps))  # (the next step holds the final validation)
    for step, m in metrics.items():
        assert m["async/policy_age_max"] <= 1, step  # the staleness bound, with workers
        assert m["rollout/status/error_abort"] == 0, step  # every aborted request resumed
        # A request is resumed only once a pull aborted it. Not (resumed > 0) == (aborted > 0):
        # a step's metrics hold its own push's aborts, whose resumes a worker reports later.
        aborted_so_far = sum(metrics[s]["generator/num_aborted_at_pull"] for s in range(step + 1))
        assert 0 <= m["generator/num_resumed_requests"] <= aborted_so_far, (step, m)
    last = metrics[num_steps - 1]
    assert last["router/generator_0/num_routed"] > 0
    assert last["router/generator_1/num_routed"] > 0
