"""``squeue --json`` of every Slurm version, read into the one shape Monarch 0.6 reads.

Monarch's `SlurmJob` reads Slurm 23.11's and newer shape (OpenAPI v0.0.40+): ``job_state`` a
list of flags and the node names under ``job_resources.nodes.allocation[].name``; it takes the
first job listed. Older Slurm prints other shapes, and 22.05's ``--json`` ignores ``--job``
(every job is listed). `job_info` picks the job by id and returns it in Monarch's shape from any
of:

    22.05 (v0.0.38)   job_state "RUNNING"            job_resources.allocated_nodes[].nodename
    23.02 (v0.0.39)   job_state ["RUNNING"]          job_resources.allocated_nodes[].nodename
    23.11+ (v0.0.40+) job_state ["RUNNING"]          job_resources.nodes.allocation[].name

and, where none of those lists is there, the job's ``nodes`` host list ("node[1-3,7]"). A
shape it cannot read is one SlurmJsonError line naming the Slurm version squeue reported.
"""

from __future__ import annotations

import json
import re
from typing import Any


class SlurmJsonError(RuntimeError):
    """``squeue --json`` printed a shape this module cannot read."""


def job_info(squeue_json: str, job_id: str) -> dict[str, Any] | None:
    """Job ``job_id`` of ``squeue --json``'s output in Monarch's shape (module doc); None when
    the job is not listed."""
    try:
        data = json.loads(squeue_json)
    except json.JSONDecodeError as e:
        raise SlurmJsonError(f"squeue --json printed no JSON ({e}): {squeue_json[:200]!r}") from None
    version = _slurm_version(data)
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise SlurmJsonError(f"squeue --json of Slurm {version} has no 'jobs' list: this "
                             f"project reads Slurm 22.05 to 25.x (docs/scaling.md)")
    for job in jobs:
        if str(_number(job.get("job_id"))) != str(job_id):
            continue
        state = job.get("job_state")
        states = [state] if isinstance(state, str) else state
        if not isinstance(states, list) or not all(isinstance(s, str) for s in states):
            raise SlurmJsonError(f"squeue --json of Slurm {version}: job {job_id}'s job_state "
                                 f"is {state!r}, neither a string nor a list of strings")
        names = node_names(job) if "RUNNING" in states else []
        if "RUNNING" in states and not names:
            raise SlurmJsonError(f"squeue --json of Slurm {version}: running job {job_id} names "
                                 f"no nodes in job_resources or nodes (docs/scaling.md)")
        return {"job_id": job_id, "job_state": states,
                "job_resources": {"nodes": {"allocation": [{"name": n} for n in names]}}}
    return None


def node_names(job: dict[str, Any]) -> list[str]:
    """A running job's node names, from whichever field its Slurm version fills."""
    resources = job.get("job_resources") or {}
    nodes = resources.get("nodes")
    if isinstance(nodes, dict) and isinstance(nodes.get("allocation"), list):  # 23.11+
        return [n["name"] for n in nodes["allocation"]]
    if isinstance(resources.get("allocated_nodes"), list):  # 22.05, 23.02
        return [n["nodename"] for n in resources["allocated_nodes"]]
    for hostlist in (nodes.get("list") if isinstance(nodes, dict) else nodes, job.get("nodes")):
        if isinstance(hostlist, str) and hostlist:
            return expand_hostlist(hostlist)
    return []


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's host list syntax: "a1,node[1-3,07]" -> ["a1", "node1", "node2", "node3", "node07"]
    (one bracket per name, as Slurm writes node lists)."""
    names = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for i in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{i:0{len(low)}d}")
    return names


def _number(value: Any) -> Any:
    """Slurm 23.02+ writes some numbers as {"set": true, "number": N}."""
    return value.get("number") if isinstance(value, dict) else value


def _slurm_version(data: Any) -> str:
    try:
        v = data["meta"]["Slurm"]["version"]
        return f"{v['major']}.{int(v['minor']):02d}.{v['micro']}"
    except (KeyError, TypeError, ValueError):
        try:
            return str(data["meta"]["slurm"]["release"])  # 23.11+: meta.slurm
        except (KeyError, TypeError):
            return "of unknown version"
