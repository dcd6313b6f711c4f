"""Where the pool puts its first generators (generator_procs.py; pure logic, fake meshes): one proc mesh over their
hosts, generator i on its own proc, where they all have TP 1 and fill their hosts evenly; else a
mesh each. The real path (four generators on simulated hosts sharing one mesh, one killed and
replaced): test_controller_relay.py."""

from __future__ import annotations

from typing import Any

from torchtitan_rl.controller.generator_procs import spawn_shared_procs
from torchtitan_rl.controller.placement import RunHosts
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

    def __len__(self) -> int:
        return self.num_hosts or 1

    def spawn_procs(self, per_host: dict[str, int], name: str) -> FakeProcs:
        self.spawned.append(per_host)
        hosts = {} if self.num_hosts is None else {"hosts": self.num_hosts}
        return FakeProcs({**hosts, **per_host})


def _shared(tps: list[int], hosts: FakeHosts, per_host: int) -> Any:
    return spawn_shared_procs([Generator.Config(tensor_parallel_degree=tp) for tp in tps],
                              RunHosts(trainer=None, generators=hosts,
                                       generators_per_host=per_host))


def test_generators_on_one_host_get_one_proc_each_of_one_mesh():
    hosts = FakeHosts(None)
    shared = _shared([1, 1, 1], hosts, per_host=0)
    assert shared is not None and hosts.spawned == [{"procs": 3}]
    procs, proc_of = shared
    assert procs.sizes == {"procs": 3}  # the mesh the pool stops at close
    assert [proc_of(i) for i in range(3)] == [{"procs": slice(i, i + 1)} for i in range(3)]


def test_generators_over_hosts_get_their_hosts_proc():
    hosts = FakeHosts(2)
    shared = _shared([1] * 4, hosts, per_host=2)
    assert shared is not None and hosts.spawned == [{"procs": 2}]
    _, proc_of = shared
    assert proc_of(3) == {"hosts": 1, "procs": slice(1, 2)}
    assert proc_of(0) == {"hosts": 0, "procs": slice(0, 1)}


def test_tensor_parallel_uneven_hosts_or_one_generator_keep_a_mesh_each():
    for tps, hosts, per_host in (([1, 2], FakeHosts(None), 0),  # TP's elastic env is per mesh
                                 ([1] * 3, FakeHosts(2), 2),  # the last host half full
                                 ([1], FakeHosts(None), 0)):
        assert _shared(tps, hosts, per_host) is None, (tps, per_host)
        assert hosts.spawned == []
