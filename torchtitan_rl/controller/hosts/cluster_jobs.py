"""Slurm and Kubernetes placements: their settings (``placement.slurm``, ``placement.kubernetes``)
and the Monarch job each becomes (`Placement.Config.monarch_job` calls these)."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

from torchtitan_rl.config.errors import ConfigError


@dataclasses.dataclass(kw_only=True, slots=True)
class SlurmPlacement:
    """`monarch.job.SlurmJob`'s settings (used when ``placement.kind = "slurm"``)."""

    partition: str = ""
    """Slurm partition ("" = the cluster's default)."""
    time_limit: str = ""
    """Job time limit as HH:MM:SS ("" = the partition's default)."""
    gpus_per_node: int = 0
    """GPUs per node (0 = request none)."""
    cpus_per_task: int = 0
    """CPUs per task (0 = Slurm's default)."""
    mem: str = ""
    """Memory per node, e.g. "256G" ("" = Slurm's default)."""
    python_exe: str = ""
    """The workers' Python ("" = this controller's interpreter; the nodes must share its path)."""
    monarch_port: int = 22222
    """TCP port the Monarch worker listens on, on every node."""
    job_name: str = "torchtitan_rl"
    """The Slurm job's name (sbatch --job-name), as squeue shows it."""
    exclusive: bool = True
    """Nodes are not shared with other jobs."""
    slurm_args: list[str] = dataclasses.field(default_factory=list)
    """More sbatch directives, e.g. ["--account=rl", "--qos=high"]."""
    log_dir: str = ""
    """Where sbatch writes its logs ("" = Monarch's default)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class KubernetesPlacement:
    """`monarch.job.kubernetes.KubernetesJob`'s settings (``placement.kind = "kubernetes"``):
    the worker pods exist already (MonarchMesh operator, or pods running the worker entry point)
    and are found by label selector."""

    namespace: str = "default"
    """Kubernetes namespace of the worker pods."""
    trainer_label_selector: str = ""
    """Selector of the trainer's pods ("" = the operator's default for mesh "trainer")."""
    generators_label_selector: str = ""
    """Selector of the generators' pods ("" = the operator's default for mesh "generators")."""
    port: int = 26600
    """The workers' Monarch port."""
    kubeconfig: str = ""
    """A kubeconfig file for running the controller outside the cluster ("" = in-cluster)."""


def slurm_job_kwargs(s: SlurmPlacement, host_timeout_s: float) -> dict[str, Any]:
    """`SlurmJob`'s keyword arguments (empty settings left to Slurm)."""
    return {
        "python_exe": s.python_exe or sys.executable,
        "slurm_args": tuple(s.slurm_args),
        "monarch_port": s.monarch_port,
        "job_name": s.job_name,
        "time_limit": s.time_limit or None,
        "partition": s.partition or None,
        "log_dir": s.log_dir or None,
        "exclusive": s.exclusive,
        "gpus_per_node": s.gpus_per_node or None,
        "cpus_per_task": s.cpus_per_task or None,
        "mem": s.mem or None,
        "job_start_timeout": math.ceil(host_timeout_s),
    }


def kubernetes_job(k8s: KubernetesPlacement, meshes: dict[str, int], host_timeout_s: float) -> Any:
    """A `KubernetesJob` over the pods ``k8s``'s label selectors find, one mesh per entry of
    ``meshes`` (name: number of hosts)."""
    try:
        from monarch.job.kubernetes import KubeConfig, KubernetesJob
    except ImportError as e:
        raise ConfigError(f"placement.kind='kubernetes' needs the kubernetes client: "
                          f"pip install kubernetes ({e})") from None

    job = KubernetesJob(
        k8s.namespace, timeout=math.ceil(host_timeout_s),
        kubeconfig=KubeConfig.from_path(k8s.kubeconfig) if k8s.kubeconfig else None)
    for name, selector in (("trainer", k8s.trainer_label_selector),
                           ("generators", k8s.generators_label_selector)):
        job.add_mesh(name, meshes[name], label_selector=selector or None, port=k8s.port)
    return job
