"""The controller's idle CPU that Monarch's supervision costs, three layouts of K procs, idle:
``meshes``, K proc meshes of one proc each (a replacement generator's, or generators with TP > 1:
a mesh each); ``shared``, one proc mesh of K procs with an actor mesh on each proc (the
generators' layout, controller/hosts/shared_procs.py: one generator is stopped or lost alone);
``one_mesh``, one proc mesh and one actor mesh over all K.

    python bench/supervision_cpu.py [--meshes 1,4,16] [--poll 1s] [--idle-s 10]

For each K, in a fresh child process (Monarch reads ``HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY``
once, at start): spawn the procs on this host, one trivial actor each, answer one call, wait
3 s, then measure the process's CPU (time.process_time: every thread, Monarch's included) over
``--idle-s`` of doing nothing, then SIGKILL one proc and time Monarch's failure report
(``detect_s``: what the poll buys), then SIGKILL a second proc of the same proc mesh and time
its report (``second_detect_s``; ``none``: no report within three polls + 40 s. Monarch reports
a mesh's failure once, so a second rank lost from one actor mesh goes unreported, and calls to
it never return: why each generator has an actor mesh of its own). ``--poll`` is Monarch's
health poll interval (``placement.health_poll_s``; a run's default is N / 2 s for N generators,
in [2, 10]; Monarch's own default is 10 s). Lines are key=value; the last one:
``per_mesh_ms_per_poll=<(CPU ms/s at the largest K - at K = 1) x poll s / (K - 1), layout
meshes> per_shared_proc_ms_per_poll=<the same, layout shared>``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time


def parse_seconds(poll: str) -> float:
    """Monarch's duration ("1s", "500ms") in seconds."""
    return float(poll.rstrip("ms")) / (1000 if poll.endswith("ms") else 1)


def measure(num_procs: int, layout: str, idle_s: float) -> tuple[float, float, float]:
    """Child mode: (the idle CPU ms per second with ``num_procs`` procs, the seconds from a proc's
    SIGKILL to Monarch's failure report, the same for a second proc killed after it: NaN when
    there is no report or no second proc)."""
    import monarch.actor
    from monarch.actor import Actor, endpoint, this_host

    reported = threading.Event()
    monarch.actor.unhandled_fault_hook = lambda failure: reported.set()
    poll_s = parse_seconds(os.environ["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"])

    async def time_report(pid: int) -> float:
        reported.clear()
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seen = await asyncio.to_thread(reported.wait, 3 * poll_s + 40.0)
        return time.monotonic() - killed if seen else float("nan")

    class Idle(Actor):
        @endpoint
        async def ping(self) -> int:
            return os.getpid()

    async def run() -> tuple[float, float, float]:
        if layout == "meshes":
            meshes = [this_host().spawn_procs(per_host={"procs": 1}, name=f"procs_{i}")
                      for i in range(num_procs)]
            slices = meshes
        else:
            meshes = [this_host().spawn_procs(per_host={"procs": num_procs}, name="procs")]
            slices = ([meshes[0].slice(procs=slice(i, i + 1)) for i in range(num_procs)]
                      if layout == "shared" else meshes)
        pids = []
        for i, procs in enumerate(slices):
            pids += [pid for _, pid in (await procs.spawn(f"idle_{i}", Idle).ping.call()).items()]
        await asyncio.sleep(3.0)  # spawning's own work settles
        start = time.process_time()
        await asyncio.sleep(idle_s)
        cpu_ms_per_s = 1e3 * (time.process_time() - start) / idle_s
        detect_s = await time_report(pids[-1])
        if len(pids) < 2:
            return cpu_ms_per_s, detect_s, float("nan")
        await asyncio.sleep(1.0)  # the first kill's reports (its actor mesh, Monarch's logger) land
        return cpu_ms_per_s, detect_s, await time_report(pids[-2])

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", default="1,4,16", help="comma-separated K, run in order")
    parser.add_argument("--poll", default="1s", help="HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--child", nargs=2, metavar=("K", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(*measure(int(args.child[0]), args.child[1], args.idle_s))
        os._exit(0)  # the killed proc's mesh: no stop to wait for
    env = {**os.environ, "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": args.poll}
    poll_s = parse_seconds(args.poll)
    counts = [int(k) for k in args.meshes.split(",")]
    idle: dict[tuple[int, str], float] = {}
    for k in counts:
        for layout in ("meshes", "shared", "one_mesh"):
            child = subprocess.run(
                [sys.executable, __file__, "--child", str(k), layout, "--idle-s", str(args.idle_s)],
                env=env, capture_output=True, text=True, timeout=300)
            if child.returncode != 0:
                raise SystemExit(f"K={k} {layout}: exit {child.returncode}: "
                                 f"{child.stderr.strip().splitlines()[-1:]}")
            cpu, detect_s, second_s = map(float, child.stdout.strip().splitlines()[-1].split())
            idle[k, layout] = cpu
            second = "none" if math.isnan(second_s) else f"{second_s:.1f}"
            print(f"procs={k} layout={layout} poll={args.poll} idle_cpu_ms_per_s={cpu:.2f} "
                  f"detect_s={detect_s:.1f}" + (f" second_detect_s={second}" if k > 1 else ""),
                  flush=True)
    k = counts[-1]
    if k > 1 and 1 in counts:
        print(" ".join(f"per_{name}_ms_per_poll="
                       f"{(idle[k, layout] - idle[1, layout]) * poll_s / (k - 1):.2f}"
                       for name, layout in (("mesh", "meshes"), ("shared_proc", "shared"))))


if __name__ == "__main__":
    main()
