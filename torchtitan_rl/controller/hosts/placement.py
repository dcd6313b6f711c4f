"""Where a run's processes live: the host meshes the trainer and the generators are spawned on.

    Placement.Config (kind and its settings) -> check(num_generators) at resolve time (exit 2)
    hosts = await placement.build().open(num_generators)        -> RunHosts, every wait bounded
        local:       this_host() for everything (one machine: the default)
        process:     monarch.job.ProcessJob({"trainer": T, "generators": G}): one worker process
                     per simulated host, over Monarch's real transport (a laptop, the tests);
                     attached once every worker listens on its socket
        attach:      attach_to_workers(workers) for workers already started with
                     ``python -m torchtitan_rl.worker --address tcp://0.0.0.0:PORT``; with
                     ``tls`` set, tls://HOST:PORT with mutual TLS (attach_tls.py)
        slurm:       monarch.job.SlurmJob(...): sbatch, one Monarch worker per node
        kubernetes:  monarch.job.kubernetes.KubernetesJob(namespace): pre-provisioned worker pods
                     found by label selector (MonarchMesh operator or your own StatefulSets)
    hosts.trainer                the trainer mesh's T hosts (its ranks spread evenly over them)
    hosts.generator_host(i)      generator i's host (all its tensor-parallel ranks stay on it);
                                 its replacement after a loss is spawned there again
    hosts.separate_machines      True when each host is its own machine by construction
                                 ("process" simulates that): weight pushes never use shared memory
    hosts.generator_workers      the generator hosts' worker addresses (attach, slurm; process:
                                 their sockets): a host whose worker stops answering is lost
                                 (host_watch.py)
    hosts.watch_trainer_hosts(on_lost)  the trainer's hosts likewise: one is gone -> on_lost
    await hosts.close()          the job's workers are stopped (process, slurm); bounded

A host that cannot be reached is one HostUnreachableError line naming it (exit 1), never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.console import CONSOLE
from torchtitan_rl.controller.hosts import attach_tls
from torchtitan_rl.controller.hosts.cluster_jobs import (
    KubernetesPlacement,
    SlurmPlacement,
    kubernetes_job,
    slurm_job_kwargs,
)
from torchtitan_rl.controller.hosts.host_watch import HostWatch
from torchtitan_rl.controller.hosts.reaper import OrphanReaper
from torchtitan_rl.controller.supervision import (
    MIN_PROMPT_HEALTH_POLL_S,
    apply_health_poll,
    auto_health_poll_s,
)

logger = logging.getLogger(__name__)

PlacementKind = Literal["local", "process", "attach", "slurm", "kubernetes"]

TRUST_ALL = "trust_all_connections"
"""Monarch's CA setting for plain TCP between workers (no TLS): trusted networks only."""


class HostUnreachableError(RuntimeError):
    """A host of the run's placement could not be reached (or its worker is gone) at start."""


class Placement(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        kind: PlacementKind = "local"
        """local: every process on this machine. process: one local worker process per host
        (simulated hosts, real transport). attach: workers you started (`workers`). slurm,
        kubernetes: hosts from the scheduler (their sections below)."""
        trainer_hosts: int = 1
        """Hosts of the trainer mesh; num_trainer_ranks is spread evenly over them."""
        generators_per_host: int = 1
        """Generators sharing one host (each keeps its tensor-parallel ranks on it); the
        generator hosts are ceil(num_generators / generators_per_host)."""
        workers: list[str] = dataclasses.field(default_factory=list)
        """attach: worker addresses, the trainer's hosts first, then the generator hosts, e.g.
        ["tcp://node0:26600", "tcp://node1:26600"] (tls://HOST:PORT with `tls`)."""
        tls: str = ""
        """attach: the job's certificate folder from `python -m torchtitan_rl.tls` (its ca.crt,
        client.crt, client.key): the workers are dialled at tls:// addresses with mutual TLS and
        accept only this job's certificates ("" = plain tcp: trusted networks only)."""
        host_timeout_s: float = 120.0
        """How long to wait for every host to be up (attach, process; slurm/kubernetes: the
        allocation too). A host not up by then fails the run, naming it."""
        health_poll_s: float = 0.0
        """Seconds between Monarch's health checks (a lost proc is noticed within one; each
        costs the controller ~1-2 ms of CPU per generator). 0 = auto: N / 2 for N generators,
        in [2, 10]; under 2 Monarch reports some losses only after ~30 s (warned).
        HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY in the environment wins."""
        slurm: SlurmPlacement = dataclasses.field(default_factory=SlurmPlacement)
        kubernetes: KubernetesPlacement = dataclasses.field(default_factory=KubernetesPlacement)

        def num_generator_hosts(self, num_generators: int) -> int:
            return math.ceil(num_generators / self.generators_per_host)

        def check(self, *, num_generators: int, num_trainer_ranks: int) -> None:
            """One ConfigError line naming the key, before anything starts."""
            if self.trainer_hosts < 1 or self.generators_per_host < 1:
                raise ConfigError(
                    f"placement.trainer_hosts ({self.trainer_hosts}) and "
                    f"placement.generators_per_host ({self.generators_per_host}) must be >= 1")
            if self.kind == "local" and self.trainer_hosts != 1:
                raise ConfigError("placement.trainer_hosts > 1 needs hosts: set placement.kind "
                                  "to process, attach, slurm or kubernetes")
            if num_trainer_ranks % self.trainer_hosts:
                raise ConfigError(
                    f"num_trainer_ranks={num_trainer_ranks} must be a multiple of "
                    f"placement.trainer_hosts={self.trainer_hosts} (the same ranks on each host)")
            if self.health_poll_s < 0:
                raise ConfigError(f"placement.health_poll_s must be >= 0 (0: auto), got "
                                  f"{self.health_poll_s}")
            if 0 < self.health_poll_s < MIN_PROMPT_HEALTH_POLL_S:
                logger.warning(
                    "placement.health_poll_s = %s: under %s s Monarch reports some lost procs only "
                    "~30 s after they die (a second one from the generators' shared proc mesh, any "
                    "one on attached workers); %s s or more reports them within one poll",
                    self.health_poll_s, MIN_PROMPT_HEALTH_POLL_S, MIN_PROMPT_HEALTH_POLL_S)
            if self.host_timeout_s <= 0:
                raise ConfigError(f"placement.host_timeout_s must be > 0, got "
                                  f"{self.host_timeout_s}")
            if self.kind != "attach" and self.workers:
                raise ConfigError(f"placement.workers is for kind 'attach' (kind is "
                                  f"{self.kind!r}): remove it or set placement.kind = \"attach\"")
            if self.kind == "attach":
                wanted = self.trainer_hosts + self.num_generator_hosts(num_generators)
                if len(self.workers) != wanted:
                    raise ConfigError(
                        f"placement.workers has {len(self.workers)} addresses; this job needs "
                        f"{wanted}: {self.trainer_hosts} for the trainer "
                        f"(placement.trainer_hosts), then "
                        f"{self.num_generator_hosts(num_generators)} for {num_generators} "
                        f"generators ({self.generators_per_host} per host)")
                for i, address in enumerate(self.workers):
                    _check_address(f"placement.workers[{i}]", address)
            attach_tls.check_addresses(self)

        def monarch_job(self, num_generators: int, env: dict[str, str] | None = None) -> Any:
            """The Monarch job for kinds process, slurm and kubernetes (not applied yet); ``env``:
            more environment for the process kind's workers (lifetime.OrphanReaper's mark)."""
            meshes = {"trainer": self.trainer_hosts,
                      "generators": self.num_generator_hosts(num_generators)}
            if self.kind == "process":
                from monarch.job import ProcessJob

                return ProcessJob(meshes, env=env)
            if self.kind == "slurm":
                from torchtitan_rl.controller.hosts.slurm_job import SlurmJob

                return SlurmJob(meshes, **slurm_job_kwargs(self.slurm, self.host_timeout_s))
            if self.kind == "kubernetes":
                return kubernetes_job(self.kubernetes, meshes, self.host_timeout_s)
            raise ValueError(f"placement.kind {self.kind!r} has no Monarch job")

    def __init__(self, config: Config) -> None:
        self.config = config

    async def open(self, num_generators: int) -> RunHosts:
        """The run's host meshes, every host up (bounded by ``host_timeout_s``)."""
        c = self.config
        attach_tls.warn_plain(c)
        apply_health_poll(c.health_poll_s or auto_health_poll_s(num_generators))
        if c.kind == "local":
            from monarch.actor import this_host

            return RunHosts(trainer=this_host(), generators=this_host(), generators_per_host=0)
        if c.kind == "attach":
            return await _attach(c)
        # Simulated hosts are sessions of their own, and a Slurm job outlives its client: both
        # are ended when this controller ends, however.
        reaper = OrphanReaper() if c.kind in ("process", "slurm") else None
        job = c.monarch_job(num_generators, env=reaper.env if reaper else None)
        if c.kind == "slurm":
            job.on_submit = reaper.cancel_slurm_job_at_exit
        try:
            # apply() submits or starts the workers; a Slurm allocation may queue: bounded too.
            try:
                if c.kind == "process":
                    await _start_simulated_hosts(job, c.host_timeout_s)
                state = await asyncio.wait_for(
                    asyncio.to_thread(job.state, cached_path=None), c.host_timeout_s)
            except TimeoutError:
                raise HostUnreachableError(
                    f"placement.kind={c.kind}: the job's hosts were not allocated and up after "
                    f"{c.host_timeout_s:g} s (placement.host_timeout_s)") from None
            hosts = RunHosts(trainer=state.trainer, generators=state.generators,
                             generators_per_host=c.generators_per_host, job=job,
                             separate_machines=c.kind == "process", reaper=reaper)
            if c.kind == "process":  # each simulated host's worker listens on a socket
                hosts.trainer_workers = _simulated_host_sockets(job, "trainer", c.trainer_hosts)
                hosts.generator_workers = _simulated_host_sockets(
                    job, "generators", c.num_generator_hosts(num_generators))
            if c.kind == "slurm":
                workers = [f"tcp://{node}:{c.slurm.monarch_port}" for node in job.hostnames()]
                hosts.trainer_workers = workers[:c.trainer_hosts]
                hosts.generator_workers = workers[c.trainer_hosts:]
                hosts.open_host = lambda name: _open_slurm_host(c, name, reaper)
            await hosts.wait_up(f"placement.kind={c.kind}", c.host_timeout_s)
            if c.kind == "slurm":
                nodes = job.hostnames()
                logger.info("slurm job %s: the trainer on %s, the generators on %s", job.job_id,
                            ", ".join(nodes[:c.trainer_hosts]),
                            ", ".join(nodes[c.trainer_hosts:]), extra=CONSOLE)
        except BaseException:
            _kill(job)
            if reaper is not None:
                reaper.close()
            raise
        return hosts


@dataclasses.dataclass(kw_only=True)
class RunHosts:
    trainer: Any
    """The trainer's HostMesh."""
    generators: Any
    """The generators' HostMesh (this host for local placement)."""
    generators_per_host: int
    """0: every generator on the one host (local placement)."""
    job: Any = None
    """The Monarch job that owns the hosts (killed at close), if any."""
    separate_machines: bool = False
    """Each host is its own machine by construction (simulated hosts): never shared memory."""
    reaper: OrphanReaper | None = None
    """Ends the job's processes if this controller ends without close (controller/hosts/reaper.py)."""
    trainer_workers: list[str] = dataclasses.field(default_factory=list)
    """The trainer hosts' worker addresses (attach, slurm; process: the simulated hosts'
    sockets): a trainer host lost whole fails the run with one line (watch_trainer_hosts), which
    a rerun resumes."""
    generator_workers: list[str] = dataclasses.field(default_factory=list)
    """The generator hosts' worker addresses, where the run knows them (attach, slurm; process:
    the simulated hosts' sockets): watched for a host lost whole (host_watch.py). Hosts added
    mid-run come after the first ones."""
    open_host: Callable[[str], Awaitable[tuple[Any, Any, str]]] | None = None
    """slurm: a new host for one more generator (a one-node allocation of its own): (its
    HostMesh, its job, its worker address). None: a generator added mid-run shares the
    generators' host (local), or cannot be added (other kinds)."""
    added: dict[int, tuple[Any, int]] = dataclasses.field(default_factory=dict)
    """Generators added mid-run on hosts of their own: index -> (HostMesh, host index)."""
    added_jobs: list[Any] = dataclasses.field(default_factory=list)
    """The allocations of those hosts (killed at close)."""
    trainer_host_lost: bool = False
    """A trainer host is gone (watch_trainer_hosts): nothing there is closed, only killed."""
    _watches: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    def generator_host_index(self, index: int) -> int:
        """The host generator ``index`` runs on (0: local placement); an added generator's host
        comes after the placement's generator hosts."""
        if index in self.added:
            return self.added[index][1]
        return index // self.generators_per_host if self.generators_per_host else 0

    def generator_host(self, index: int) -> Any:
        if index in self.added:
            return self.added[index][0]
        if self.generators_per_host == 0:
            return self.generators
        return self.generators.slice(hosts=self.generator_host_index(index))

    def watch_trainer_hosts(self, on_lost: Callable[[str], None], interval_s: float) -> None:
        """Watch the trainer's hosts (host_watch.py) until close: ``on_lost(why)`` once one is
        gone. Monarch 0.6 reports the loss of a whole host late or never (host_watch.py); the
        trainer's restart respawns it on its own host, which a gone host cannot give."""
        if not self.trainer_workers:
            return

        def lost(index: int, reason: str) -> None:
            self.trainer_host_lost = True
            on_lost(f"the trainer's host is gone: {reason}; run the same command again to "
                    f"resume from the last checkpoint")

        watch = HostWatch(self.trainer_workers, lost, interval_s=interval_s)
        self._watches.append(asyncio.create_task(watch.run(), name="trainer-host-watch"))

    async def add_generator_host(self, index: int) -> Any:
        """The host for generator ``index``, added mid-run: a new one where the placement makes
        hosts (slurm), else the generators' one host (local). Raises HostUnreachableError
        where neither holds."""
        if self.open_host is not None:
            mesh, job, address = await self.open_host(f"generator_{index}")
            self.added_jobs.append(job)
            self.generator_workers.append(address)
            self.added[index] = (mesh, len(self.generator_workers) - 1)
            return mesh
        if self.generators_per_host == 0:
            return self.generators
        raise HostUnreachableError(
            "this placement cannot add a generator's host mid-run (placement.kind local and "
            "slurm can)")

    async def wait_up(self, what: str, timeout_s: float) -> None:
        for name, mesh in (("trainer", self.trainer), ("generators", self.generators)):
            try:
                await asyncio.wait_for(mesh.initialized, timeout_s)
            except TimeoutError:
                raise HostUnreachableError(
                    f"{what}: the {name} hosts were not up after {timeout_s:g} s "
                    f"(placement.host_timeout_s)") from None
            except Exception as e:
                raise HostUnreachableError(
                    f"{what}: the {name} hosts could not be reached: "
                    f"{' '.join(str(e).split())[:300]}") from e

    async def close(self, timeout_s: float = 60.0) -> None:
        for task in self._watches:
            task.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        try:
            for job in [self.job, *self.added_jobs]:
                if job is not None:
                    await asyncio.wait_for(asyncio.to_thread(_kill, job), timeout_s)
        finally:
            if self.reaper is not None:  # whatever the kill left (or a kill that timed out)
                await asyncio.to_thread(self.reaper.close)


async def _open_slurm_host(c: Placement.Config, name: str,
                           reaper: OrphanReaper | None) -> tuple[Any, Any, str]:
    """A one-node Slurm allocation of its own for mesh ``name`` (a generator added mid-run),
    cancelled with the run's; bounded by ``placement.host_timeout_s``."""
    from torchtitan_rl.controller.hosts.slurm_job import SlurmJob

    job = SlurmJob({name: 1}, **slurm_job_kwargs(c.slurm, c.host_timeout_s))
    if reaper is not None:
        job.on_submit = reaper.cancel_slurm_job_at_exit
    try:
        state = await asyncio.wait_for(asyncio.to_thread(job.state, cached_path=None),
                                       c.host_timeout_s)
        mesh = getattr(state, name)
        await asyncio.wait_for(mesh.initialized, c.host_timeout_s)
    except BaseException as e:
        _kill(job)
        if isinstance(e, TimeoutError):
            raise HostUnreachableError(
                f"placement.kind=slurm: a node for {name} was not allocated and up after "
                f"{c.host_timeout_s:g} s (placement.host_timeout_s)") from None
        raise
    node = job.hostnames()[0]
    logger.info("slurm job %s: %s on %s", job.job_id, name, node, extra=CONSOLE)
    return mesh, job, f"tcp://{node}:{c.slurm.monarch_port}"


async def _attach(c: Placement.Config) -> RunHosts:
    from monarch.actor import attach_to_workers

    # Monarch's attach waits a minute per dead worker before failing, without naming it: a TCP
    # connect first names the address at once.
    for i, address in enumerate(c.workers):
        await _probe(f"placement.workers[{i}]", address, c.host_timeout_s)
    attach_tls.use_client_tls(c)
    trainer = attach_to_workers(ca=TRUST_ALL, workers=c.workers[:c.trainer_hosts],
                                name="trainer")
    generators = attach_to_workers(ca=TRUST_ALL, workers=c.workers[c.trainer_hosts:],
                                   name="generators")
    hosts = RunHosts(trainer=trainer, generators=generators,
                     generators_per_host=c.generators_per_host,
                     trainer_workers=c.workers[:c.trainer_hosts],
                     generator_workers=c.workers[c.trainer_hosts:])
    if not c.tls:
        await hosts.wait_up(f"placement.workers {c.workers}", c.host_timeout_s)
        return hosts
    # A worker that rejects the client (or a client that rejects the worker) is silent until
    # Monarch's attach timeout (set above, just under host_timeout_s, so that its error, which
    # names the host, comes first): name the workers and the causes.
    deadline = asyncio.get_running_loop().time() + c.host_timeout_s
    for mesh, addresses in ((trainer, c.workers[:c.trainer_hosts]),
                            (generators, c.workers[c.trainer_hosts:])):
        try:
            await asyncio.wait_for(mesh.initialized,
                                   max(0.0, deadline - asyncio.get_running_loop().time()))
        except Exception as e:
            error = None if isinstance(e, asyncio.TimeoutError) else e
            raise HostUnreachableError(attach_tls.rejected(error, c, addresses)) from None
    return hosts


async def _start_simulated_hosts(job: Any, timeout_s: float) -> None:
    """Start a ProcessJob's workers and return once each listens on its socket. Monarch 0.6
    drops an attach message sent before a worker listens once its delivery timeout passes, and
    the attach never completes ("config push failed during attach")."""
    await asyncio.to_thread(job.apply)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # ProcessJob keeps {host: ProcessState(pid, "ipc://PATH")}; no public accessor in 0.6.
    for host, worker in job._host_to_pid.items():
        path = urllib.parse.urlsplit(worker.channel).path
        while True:
            try:
                _, writer = await asyncio.open_unix_connection(path)
                writer.close()
                break
            except OSError:
                if not job._pids_active():  # a worker of the job is gone
                    raise HostUnreachableError(
                        f"placement.kind=process: a simulated host's worker exited while "
                        f"starting ({host} was not listening on {path} yet)") from None
                if loop.time() > deadline:
                    raise HostUnreachableError(
                        f"placement.kind=process: the simulated host {host} did not listen on "
                        f"{path} after {timeout_s:g} s (placement.host_timeout_s)") from None
                await asyncio.sleep(0.05)  # polling a socket that is not bound yet


def _simulated_host_sockets(job: Any, mesh: str, count: int) -> list[str]:
    """The ipc:// addresses of a ProcessJob's workers for ``mesh`` (hosts ``<mesh>_<i>``)."""
    return [job._host_to_pid[f"{mesh}_{i}"].channel for i in range(count)]


def _check_address(key: str, address: str) -> None:
    parsed = urllib.parse.urlsplit(address)
    if parsed.scheme in ("tcp", "tls"):
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise ConfigError(f"{key}={address!r}: write {parsed.scheme}://HOST:PORT")
    elif parsed.scheme not in ("ipc", "metatls"):
        raise ConfigError(f"{key}={address!r}: a worker address is tcp://HOST:PORT, "
                          "tls://HOST:PORT (with placement.tls), ipc://PATH or metatls://HOST:PORT")


async def _probe(key: str, address: str, timeout_s: float) -> None:
    """A TCP connect to the worker; refused connections are retried for ``timeout_s`` (a worker
    started just before the run may not listen yet)."""
    parsed = urllib.parse.urlsplit(address)
    if parsed.scheme not in ("tcp", "tls", "metatls"):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parsed.hostname, parsed.port),
                max(0.1, deadline - loop.time()))
        except (TimeoutError, OSError) as e:
            if isinstance(e, ConnectionRefusedError) and loop.time() + 0.2 < deadline:
                await asyncio.sleep(0.2)  # polling a socket that is not open yet
                continue
            tls_dir = " --tls-dir DIR" if parsed.scheme == "tls" else ""
            raise HostUnreachableError(
                f"{key} {address}: no worker answers there after {timeout_s:g} s "
                f"({type(e).__name__}: {e}); start one with python -m torchtitan_rl.worker "
                f"--address {address}{tls_dir}") from None
        writer.close()
        return


def _kill(job: Any) -> None:
    try:
        job.kill()
    except Exception as e:  # the workers may be gone already
        logger.warning("stopping the placement's workers: %r", e)

