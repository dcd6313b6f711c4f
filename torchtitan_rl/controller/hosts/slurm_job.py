"""Monarch's `SlurmJob`, reading the ``squeue --json`` of the Slurm a user has.

    Placement.Config.monarch_job -> SlurmJob(meshes, **slurm_job_kwargs)   (sbatch on apply)
    Monarch's state() -> _create -> sbatch -> on_submit(job_id): the reaper scancels it at exit
    Monarch's state()/kill() -> _get_job_info_json(job_id) -> squeue --json
        -> squeue_json.job_info(...): the job in the shape Monarch 0.6 reads, whatever the version
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from typing import Any

from monarch.job import SlurmJob as MonarchSlurmJob

from torchtitan_rl.controller.hosts.squeue_json import job_info

logger = logging.getLogger(__name__)


class SlurmJob(MonarchSlurmJob):
    """`monarch.job.SlurmJob` whose job queries read every Slurm version's JSON (module doc)."""

    def __init__(self, meshes: dict[str, int], **kwargs: Any) -> None:
        # A node failure must not end the job (Slurm's default): the run replaces or retires
        # what ran there and goes on with the other nodes. --no-kill keeps the allocation;
        # SLURM_NO_KILL (read by the srun that Monarch's batch script starts the workers with,
        # inherited through sbatch's environment) keeps the workers' step.
        slurm_args = tuple(kwargs.pop("slurm_args", ()))
        if not any(a.startswith(("--no-kill", "-k")) for a in slurm_args):
            slurm_args = ("--no-kill", *slurm_args)
        os.environ.setdefault("SLURM_NO_KILL", "set")
        super().__init__(meshes, slurm_args=slurm_args, **kwargs)

    on_submit: Callable[[str], None] | None = None
    """Called with the job id as soon as sbatch returns it (the reaper's scancel at exit)."""

    def _create(self, client_script: str | None) -> None:
        super()._create(client_script)
        if self.on_submit is not None and self._slurm_job_id is not None:
            self.on_submit(self._slurm_job_id)

    @property
    def job_id(self) -> str | None:
        """The submitted job's id (None before apply or after kill)."""
        return self._slurm_job_id

    def hostnames(self) -> list[str]:
        """The allocated nodes, in the order Monarch gives them to the meshes."""
        return list(self._all_hostnames)

    def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
        done = subprocess.run(["squeue", "--job", job_id, "--json"], capture_output=True,
                              text=True)
        if done.returncode:
            # squeue exits non-zero for a job it no longer knows: as Monarch does, "not found"
            logger.warning("squeue --job %s: %s", job_id, " ".join(done.stderr.split()))
            return None
        return job_info(done.stdout, job_id)
