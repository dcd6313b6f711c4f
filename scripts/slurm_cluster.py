"""A real Slurm cluster on this one machine: one slurmctld and N slurmd nodes, for trying and
testing ``placement.kind = "slurm"`` (docs/scaling.md, "A Slurm cluster on one box").

    python3 scripts/slurm_cluster.py up [--nodes 3]   # idempotent: a running cluster is kept
    python3 scripts/slurm_cluster.py status           # sinfo, squeue, the daemons' pids
    python3 scripts/slurm_cluster.py exec -- CMD ...  # CMD on the "login node" (names resolve)
    python3 scripts/slurm_cluster.py kill-node node2  # a node failure: every process on it killed
    python3 scripts/slurm_cluster.py start-node node2 # the node back (or a new one joins)
    python3 scripts/slurm_cluster.py down             # every job cancelled, every daemon stopped

Everything lives in one directory of its own (``--dir``, default /tmp/torchtitan_rl_slurm):
slurm.conf, the munge key and socket, the daemons' state, spool, logs and pid files. Nothing of
the system is changed beyond the Debian packages (installed with apt when missing, as root).

Each node is its own host: its slurmd runs in a UTS namespace with the node's hostname and a
mount namespace whose /etc/hosts (a private file bind-mounted over it; the system's is never
edited) maps node<i> to 127.0.0.<10+i>. Every process a job starts on the node inherits both, so
Monarch's worker there listens on ``tcp://node<i>:PORT`` at the node's own loopback address and
the nodes' workers share one port without colliding. A program that talks to the nodes by name
(the run's controller) runs under ``exec``: the same hosts file, the machine's own hostname.
A node's processes are exactly those in its UTS namespace, which is how ``kill-node`` and
``down`` find them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

DEFAULT_DIR = pathlib.Path("/tmp/torchtitan_rl_slurm")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PORT = 6817
"""slurmctld's port; the nodes' slurmd take the next ones (PORT + i)."""
ADDRESS = 10
"""Node i's address is 127.0.0.<ADDRESS + i>."""
PARTITION = "debug"


class ClusterError(RuntimeError):
    """The cluster could not be started or stopped; the message is one line for a person."""


def node_name(index: int) -> str:
    return f"node{index}"


@dataclasses.dataclass
class Cluster:
    """The cluster in ``directory``; ``procs`` holds the daemons this process started (a
    pytest fixture keeps them as its children, so they are reaped when stopped)."""

    directory: pathlib.Path = DEFAULT_DIR
    num_nodes: int = 3
    port: int = PORT
    """slurmctld's port; node i's slurmd listens on port + i (two clusters need other ports)."""
    address: int = ADDRESS
    """Node i's address is 127.0.0.<address + i> (Monarch's worker port is the same on every
    node: two clusters need other addresses)."""
    procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)

    # ---- paths ----
    @property
    def conf(self) -> pathlib.Path:
        return self.directory / "slurm.conf"

    @property
    def hosts_file(self) -> pathlib.Path:
        return self.directory / "hosts"

    @property
    def pids_file(self) -> pathlib.Path:
        return self.directory / "pids.json"

    @property
    def munge_socket(self) -> pathlib.Path:
        return self.directory / "munge" / "munge.socket"

    def env(self) -> dict[str, str]:
        """The environment Slurm's commands need to find this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(1, self.num_nodes + 1)]

    def node_address(self, index: int) -> str:
        return f"127.0.0.{self.address + index}"

    # ---- up ----
    def up(self, *, detach: bool) -> None:
        """Start the cluster unless it runs; return once ``sinfo`` shows every node idle."""
        install_packages()
        if self.running():
            self.wait_idle(self.node_names())
            return
        self.down()  # whatever a crashed cluster left (pids, jobs, state)
        if self.directory.exists():
            shutil.rmtree(self.directory)
        for sub in ("state", "log", "munge"):
            (self.directory / sub).mkdir(parents=True)
        self._write_files()
        self._start("munged", ["munged", "--foreground", "--force",
                               f"--socket={self.munge_socket}",
                               f"--key-file={self.directory / 'munge' / 'munge.key'}",
                               f"--pid-file={self.directory / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.directory / 'munge' / 'munged.seed'}",
                               f"--log-file={self.directory / 'log' / 'munged.log'}"],
                    detach=detach)
        _wait(lambda: self.munge_socket.exists(), 10, "munged did not open its socket",
              self.directory / "log" / "munged.log")
        self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], detach=detach)
        for name in self.node_names():
            self.start_node(name, detach=detach)
        self.wait_idle(self.node_names())

    def start_node(self, name: str, *, detach: bool) -> None:
        """Start node ``name``'s slurmd in namespaces of its own (a node joining the cluster)."""
        script = (f"mount --bind {self.hosts_file} /etc/hosts && hostname {name} && "
                  f"exec slurmd -D -N {name} -f {self.conf}")
        self._start(name, ["unshare", "--uts", "--mount", "--propagation", "private",
                           "sh", "-c", script], detach=detach)

    def _start(self, key: str, cmd: list[str], *, detach: bool) -> None:
        log = open(self.directory / "log" / f"{key}.out", "ab")
        proc = subprocess.Popen(cmd, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[key] = proc
        pids = self._read_pids()
        pids[key] = proc.pid
        self.pids_file.write_text(json.dumps(pids))
        if detach:
            self.procs.pop(key)

    def _write_files(self) -> None:
        host = socket.gethostname()
        d = self.directory
        (d / "munge" / "munge.key").write_bytes(secrets.token_bytes(128))
        os.chmod(d / "munge" / "munge.key", 0o400)
        hosts = ["127.0.0.1 localhost", f"127.0.0.1 {host}"]
        hosts += [f"{self.node_address(i)} {node_name(i)}" for i in range(1, self.num_nodes + 1)]
        self.hosts_file.write_text("\n".join(hosts) + "\n")
        lines = [
            "ClusterName=torchtitan_rl",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'state' / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'state' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'state' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            # A node that stops answering is DOWN after SlurmdTimeout; a cancelled job's
            # processes get KillWait seconds between SIGTERM and SIGKILL.
            "SlurmdTimeout=10",
            "KillWait=5",
            "InactiveLimit=0",
            "MinJobAge=300",
        ]
        for i in range(1, self.num_nodes + 1):
            lines.append(f"NodeName={node_name(i)} NodeHostname={node_name(i)} "
                         f"NodeAddr={self.node_address(i)} Port={self.port + i} "
                         f"CPUs=1 RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # ---- queries ----
    def _read_pids(self) -> dict[str, int]:
        try:
            return json.loads(self.pids_file.read_text())
        except (OSError, ValueError):
            return {}

    def running(self) -> bool:
        """Every daemon of the pid file is alive (and the nodes' count matches)."""
        pids = self._read_pids()
        wanted = {"munged", "slurmctld", *self.node_names()}
        return wanted <= set(pids) and all(_alive(pids[k]) for k in wanted)

    def sinfo(self) -> dict[str, str]:
        """{node: state} as sinfo reports it (e.g. idle, alloc, down*)."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(),
                             capture_output=True, text=True, timeout=10)
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())

    def squeue(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(),
                             capture_output=True, text=True, timeout=10)
        return out.stdout.split()

    def wait_idle(self, names: list[str], timeout_s: float = 120.0) -> None:
        def idle() -> bool:
            try:
                states = self.sinfo()
            except (subprocess.SubprocessError, ValueError):
                return False
            return all(states.get(n) == "idle" for n in names)

        _wait(idle, timeout_s, f"nodes {names} not idle in sinfo", self.directory / "log")

    def node_pids(self, name: str) -> list[int]:
        """Every process on node ``name``: those in its slurmd's UTS namespace."""
        pid = self._read_pids().get(name)
        if pid is None or not _alive(pid):
            return []
        # unshare execs sh, which execs slurmd: the recorded pid is slurmd in the namespace.
        try:
            uts = os.readlink(f"/proc/{pid}/ns/uts")
        except OSError:
            return []
        found = []
        for entry in pathlib.Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "uts") == uts:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    # ---- failures and shutdown ----
    def kill_node(self, name: str) -> int:
        """A node failure: SIGKILL to its slurmd and every process on it; returns how many."""
        pids = self.node_pids(name)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.wait(10)
        return len(pids)

    def down(self) -> None:
        """Cancel every job, stop every daemon of the pid file (and every process on the
        nodes), by pid. Safe after a crash and when nothing runs."""
        pids = self._read_pids()
        if pids and _alive(pids.get("slurmctld", -1)):
            subprocess.run(["scancel", "--full", f"--partition={PARTITION}"], env=self.env(),
                           capture_output=True, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    if not self.squeue():
                        break
                except subprocess.SubprocessError:
                    break
                time.sleep(0.2)  # polling the queue while slurmd ends the jobs' steps
        node_procs = [p for name in pids if name.startswith("node") for p in self.node_pids(name)]
        daemons = [pid for pid in pids.values() if _alive(pid)]
        for pid in daemons + node_procs:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in daemons + node_procs):
            time.sleep(0.1)  # polling the daemons' exit after SIGTERM
        for pid in daemons + node_procs:
            _signal(pid, signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        if self.pids_file.exists():
            self.pids_file.unlink()

    def status(self) -> str:
        pids = self._read_pids()
        lines = [f"directory {self.directory}", f"SLURM_CONF={self.conf}"]
        lines += [f"{k} pid={v} {'up' if _alive(v) else 'gone'}" for k, v in pids.items()]
        if pids and _alive(pids.get("slurmctld", -1)):
            lines += [f"sinfo {n} {s}" for n, s in sorted(self.sinfo().items())]
            lines.append(f"squeue {' '.join(self.squeue()) or '(empty)'}")
        else:
            lines.append("not running")
        return "\n".join(lines)

    def exec_argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` on the login node: a mount namespace with the cluster's hosts file."""
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'mount --bind {self.hosts_file} /etc/hosts && exec "$@"', "sh", *cmd]


def install_packages() -> None:
    """The Debian packages, installed with apt when a command is missing (root only)."""
    if all(shutil.which(c) for c in ("slurmctld", "slurmd", "sinfo", "munged", "unshare")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterError(f"Slurm is not installed and cannot be installed here (needs root and "
                           f"apt-get): apt-get install {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            tail = " ".join(done.stderr.split())[-300:]
            raise ClusterError(f"{' '.join(cmd)} failed ({done.returncode}): {tail}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait(ready, timeout_s: float, what: str, logs: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} after {timeout_s:g} s (logs: {logs})")
        time.sleep(0.1)  # polling a daemon that is starting


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status", "exec", "kill-node",
                                            "start-node"))
    parser.add_argument("node", nargs="?", help="kill-node, start-node: the node's name")
    parser.add_argument("--dir", type=pathlib.Path, default=DEFAULT_DIR)
    parser.add_argument("--nodes", type=int, default=3, help="slurmd nodes (up; default 3)")
    parser.add_argument("--port", type=int, default=PORT,
                        help="slurmctld's port; node i's slurmd takes port + i (up)")
    parser.add_argument("--address", type=int, default=ADDRESS,
                        help="node i's address is 127.0.0.<address + i> (up)")
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    a = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.nodes < 2:
        parser.error("--nodes must be >= 2")
    cluster = Cluster(a.dir, a.nodes, a.port, a.address)
    try:
        if a.command == "up":
            cluster.up(detach=True)
            print(cluster.status())
        elif a.command == "down":
            cluster.down()
        elif a.command == "status":
            print(cluster.status())
        elif a.command == "exec":
            if not cmd:
                parser.error("exec needs a command: exec -- CMD ...")
            os.execvpe("unshare", cluster.exec_argv(cmd), cluster.env())
        elif a.command in ("kill-node", "start-node"):
            if a.node is None:
                parser.error(f"{a.command} needs a node's name, e.g. {a.command} node2")
            if a.command == "kill-node":
                print(f"{a.node}: {cluster.kill_node(a.node)} processes killed")
            else:
                cluster.start_node(a.node, detach=True)
                cluster.wait_idle([a.node])
    except ClusterError as e:
        print(f"slurm_cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
