"""Where the pools put their first generators and rollout workers (shared_procs.py; pure logic,
fake meshes): one proc mesh over the generators' hosts, actor i on its own proc of its host, where
the actors fill their hosts evenly; else a mesh each (and TP > 1 generators always). The real
paths: four generators on simulated hosts sharing one mesh, one killed and replaced
(tests/weight_sync/test_weight_sync_relay_job.py); a rollout worker on the shared mesh killed and replaced
(test_controller_rollout_workers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from torchtitan_rl.controller.hosts.placement import RunHosts
from torchtitan_rl.controller.hosts.shared_procs import spawn_generator_procs, spawn_shared_procs
from torchtitan_rl.generator import Generator


class FakeProcs:
    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    def slice(self, **where: Any) -> dict[str, Any]:
        return where


class FakeHosts:
    def __init__(self, num_hosts: int | None) -> None:
        self.num_hosts = num_hosts
        """None: this_host() (no hosts dimension)."""
        self.spawned: list[dict[str, int]] = []
        self.sliced: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self.num_hosts or 1

    def slice(self, **where: Any) -> FakeHosts:
        self.sliced.append(where)
        part = FakeHosts(len(range(self.num_hosts or 1)[where["hosts"]]))
        part.spawned = self.spawned
        return part

    def spawn_procs(self, per_host: dict[str, int], name: str) -> FakeProcs:
        self.spawned.append(per_host)
        hosts = {} if self.num_hosts is None else {"hosts": self.num_hosts}
        return FakeProcs({**hosts, **per_host})


def _shared(num: int, hosts: FakeHosts, per_host: int, of: int | None = None) -> Any:
    """``num`` actors placed as the pools place them: actor i on generator (i mod ``of``)'s host
    (generators: ``of`` = num; rollout workers: ``of`` = the number of generators)."""
    run_hosts = RunHosts(trainer=None, generators=hosts, generators_per_host=per_host)
    host_of = [run_hosts.generator_host_index(i % (of or num)) for i in range(num)]
    return spawn_shared_procs(run_hosts, host_of, "actors")


def test_actors_on_one_host_get_one_proc_each_of_one_mesh():
    hosts = FakeHosts(None)
    shared = _shared(3, hosts, per_host=0)
    assert shared is not None and hosts.spawned == [{"procs": 3}]
    procs, proc_of = shared
    assert procs.sizes == {"procs": 3}  # the mesh the pool stops at close
    assert [proc_of(i) for i in range(3)] == [{"procs": slice(i, i + 1)} for i in range(3)]


def test_actors_over_hosts_get_their_hosts_proc():
    hosts = FakeHosts(2)
    shared = _shared(4, hosts, per_host=2)
    assert shared is not None and hosts.spawned == [{"procs": 2}] and hosts.sliced == []
    _, proc_of = shared
    assert proc_of(3) == {"hosts": 1, "procs": slice(1, 2)}
    assert proc_of(0) == {"hosts": 0, "procs": slice(0, 1)}


def test_two_workers_over_sixteen_generator_hosts_share_the_first_two_hosts():
    hosts = FakeHosts(16)
    shared = _shared(2, hosts, per_host=1, of=16)
    assert shared is not None
    assert hosts.sliced == [{"hosts": slice(0, 2)}] and hosts.spawned == [{"procs": 1}]
    procs, proc_of = shared
    assert procs.sizes == {"hosts": 2, "procs": 1}
    assert [proc_of(i) for i in range(2)] == [{"hosts": i, "procs": slice(0, 1)}
                                              for i in range(2)]


def test_workers_wrapping_around_the_generators_take_a_second_proc_of_a_host():
    # 4 workers over 2 generators on 2 hosts: workers 0 and 2 on host 0, 1 and 3 on host 1
    hosts = FakeHosts(2)
    shared = _shared(4, hosts, per_host=1, of=2)
    assert shared is not None and hosts.spawned == [{"procs": 2}]
    _, proc_of = shared
    assert [proc_of(i) for i in range(4)] == [
        {"hosts": 0, "procs": slice(0, 1)}, {"hosts": 1, "procs": slice(0, 1)},
        {"hosts": 0, "procs": slice(1, 2)}, {"hosts": 1, "procs": slice(1, 2)}]


@pytest.mark.parametrize("num, num_hosts, per_host, of", [
    (3, 2, 2, None),  # the last host half full
    (3, 2, 1, 2),  # 3 workers over 2 generator hosts: 2 on one, 1 on the other
    (1, None, 0, None),  # one actor: nothing to share
])
def test_uneven_hosts_or_one_actor_keep_a_mesh_each(num, num_hosts, per_host, of):
    hosts = FakeHosts(num_hosts)
    assert _shared(num, hosts, per_host, of) is None
    assert hosts.spawned == []


def test_generators_share_a_mesh_unless_one_has_tensor_parallelism():
    def generators(tps: list[int], hosts: FakeHosts, per_host: int) -> Any:
        return spawn_generator_procs(
            [Generator.Config(tensor_parallel_degree=tp) for tp in tps],
            RunHosts(trainer=None, generators=hosts, generators_per_host=per_host))

    hosts = FakeHosts(2)
    shared = generators([1] * 4, hosts, per_host=2)
    assert shared is not None and hosts.spawned == [{"procs": 2}]
    assert shared[1](3) == {"hosts": 1, "procs": slice(1, 2)}
    hosts = FakeHosts(None)
    assert generators([1, 2], hosts, per_host=0) is None  # TP's elastic env is per mesh
    assert hosts.spawned == []
