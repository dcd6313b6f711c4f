"""Where the first generators' procs come from: one proc mesh over the generators' hosts, one
proc a generator, where that layout holds them (every generator TP 1, hosts filled evenly).

    GeneratorPool.spawn -> spawn_shared_procs(configs, hosts) -> (mesh, proc_of) or None
        proc_of(i): generator i's one-proc slice -> spawn_generator(procs=...) spawns its own
        actor mesh there (named as before: it is reported, stopped and replaced alone)
        None: TP > 1 (torch's elastic env is set per mesh), half-full hosts, one generator:
        spawn_generator spawns a mesh each, as it does for every replacement

Why: Monarch's health poll costs the controller CPU per mesh (bench/supervision_cpu.py: ~2.1 ms
per one-proc mesh per poll, ~1.0 ms per actor mesh on a shared proc mesh). A proc of the mesh
that dies leaves the others serving; the pool stops the mesh at close.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from monarch.actor import ProcMesh

from torchtitan_rl.controller.placement import RunHosts
from torchtitan_rl.generator import Generator

logger = logging.getLogger(__name__)


def spawn_shared_procs(configs: list[Generator.Config], hosts: RunHosts,
                       ) -> tuple[ProcMesh, Callable[[int], ProcMesh]] | None:
    """The generators' one proc mesh and generator i's proc in it; None: a mesh each."""
    num, per_host = len(configs), hosts.generators_per_host
    if num < 2 or any(c.tensor_parallel_degree != 1 for c in configs):
        return None
    if per_host == 0:  # every generator on the one host
        per_host = num
    elif num % per_host or len(hosts.generators) != num // per_host:
        return None
    procs = hosts.generators.spawn_procs(per_host={"procs": per_host}, name="generators")
    logger.info("generators: one proc mesh for %d generators on %d host(s)", num,
                num // per_host)

    def proc_of(index: int) -> ProcMesh:
        where: dict[str, Any] = {"procs": slice(index % per_host, index % per_host + 1)}
        if "hosts" in procs.sizes:  # this_host() has no hosts dimension
            where["hosts"] = index // per_host
        return procs.slice(**where)

    return procs, proc_of
