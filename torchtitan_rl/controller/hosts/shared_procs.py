"""One proc mesh for many one-proc actors on the generators' hosts: the first generators (TP 1),
and the rollout workers.

    GeneratorPool.spawn -> spawn_generator_procs(configs, hosts)  (None at TP > 1: torch's
                           elastic env is set per mesh)
    GeneratorPool.spawn, RolloutWorkerPool.spawn
      -> spawn_shared_procs(hosts, host_of, name) -> (mesh, proc_of) or None
         proc_of(i): actor i's one-proc slice, on generator host host_of[i]; the caller spawns
         its own actor mesh there (named as a mesh of its own would be: it is reported, stopped
         and replaced alone)
         None: fewer than two, hosts not filled evenly, or several machines of their own
         (slurm, attach: one lost would take the mesh with it): the caller spawns a mesh each,
         as it does for every replacement

Why: Monarch's health poll costs the controller CPU per proc mesh (bench/supervision_cpu.py:
~2.1 ms per one-proc mesh per poll, ~1.0 ms per actor mesh on a shared proc mesh; two rollout
workers on their own meshes cost ~9 ms a second at the 1 s poll, on one mesh ~0.5). A proc of the
mesh that dies leaves the others serving; the caller stops the mesh at close. Not one actor mesh
over them all: Monarch reports an actor mesh's failure once, so a second rank lost from it would go
unreported and calls to it would never return (bench/supervision_cpu.py, second_detect_s).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from monarch.actor import ProcMesh

from torchtitan_rl.controller.hosts.placement import RunHosts
from torchtitan_rl.generator import Generator

logger = logging.getLogger(__name__)


def spawn_shared_procs(hosts: RunHosts, host_of: list[int], name: str,
                       ) -> tuple[ProcMesh, Callable[[int], ProcMesh]] | None:
    """One proc mesh ``name`` with a proc for each actor i on generator host ``host_of[i]``
    (``RunHosts.generator_host_index``), and actor i's proc in it; None: a mesh each."""
    per_host_counts = collections.Counter(host_of)
    used = sorted(per_host_counts)
    if (len(host_of) < 2 or used != list(range(len(used)))
            or len(set(per_host_counts.values())) != 1):
        return None
    if hosts.generator_workers and not hosts.separate_machines and len(used) > 1:
        # Machines of their own (slurm, attach): a proc mesh over several dies with any of them
        # (a lost Slurm node's peer on another node was reaped as orphaned within 10 s).
        # Simulated hosts (placement "process") all run on this one machine: a proc mesh over
        # them outlives one host's loss (its proc on the host left serves on).
        return None
    per_host = per_host_counts[0]
    mesh = hosts.generators
    if hosts.generators_per_host and len(used) < len(mesh):  # the first hosts only
        mesh = mesh.slice(hosts=slice(0, len(used)))
    procs = mesh.spawn_procs(per_host={"procs": per_host}, name=name)
    logger.info("%s: one proc mesh for %d on %d host(s)", name, len(host_of), len(used))
    rank_on_host: list[int] = []
    seen: collections.Counter[int] = collections.Counter()
    for host in host_of:
        rank_on_host.append(seen[host])
        seen[host] += 1

    def proc_of(index: int) -> ProcMesh:
        rank = rank_on_host[index]
        where: dict[str, Any] = {"procs": slice(rank, rank + 1)}
        if "hosts" in procs.sizes:  # this_host() has no hosts dimension
            where["hosts"] = host_of[index]
        return procs.slice(**where)

    return procs, proc_of


def spawn_generator_procs(configs: list[Generator.Config], hosts: RunHosts,
                          ) -> tuple[ProcMesh, Callable[[int], ProcMesh]] | None:
    """The first generators' shared proc mesh; None (a mesh each) when one has TP > 1: torch's
    elastic env is set per mesh."""
    if any(c.tensor_parallel_degree != 1 for c in configs):
        return None
    return spawn_shared_procs(hosts, [hosts.generator_host_index(i) for i in range(len(configs))],
                              "generators")
