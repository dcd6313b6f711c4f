"""How long the idle threads of a run's processes spin: set in the environment before torch loads
OpenMP.

torch's CPU kernels run on libgomp's thread team. A thread that finishes its share of a kernel spins
before it sleeps, so that the next kernel finds it awake; libgomp's default spin (about 300,000
turns, a few milliseconds) assumes the process has its cores to itself. Beside another CPU-bound
process the spinning threads of one take the cores from the working threads of the other and both
crawl. With ``GOMP_SPINCOUNT=10000`` a thread still spins across the short gaps between the
kernels of one step (a process alone runs as fast as with the default) but sleeps soon when it
waits longer, as it does beside another job. Set before torch is imported, it holds for the controller (the warm start trains there) and,
through the environment they inherit, for the trainer and generator procs. How many threads each
process uses is each part's own setting (``warm_start.num_threads``, ``trainer.num_threads``,
``generator.torch_num_threads``; docs/main_job.md, "Threads"); ``bench/shared_box.py`` measures the
spin counts alone and beside another job.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"


def set_openmp_spin() -> None:
    """``GOMP_SPINCOUNT`` for this process and its children unless the user chose how OpenMP
    threads wait (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set); call before torch is imported."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
