"""The project's SlurmJob reads ``squeue --json`` of Slurm 22.05, 23.02 and 23.11+ and hands
Monarch the one shape Monarch 0.6 reads. squeue_22.05.json is Debian's Slurm 22.05.8 output
(scripts/slurm_cluster.py's cluster, trimmed to the fields read and a few more); the 23.02 and
24.11 files follow those releases' OpenAPI schemas (v0.0.39; data_parser v0.0.42)."""

from __future__ import annotations

import json
import pathlib

import pytest

from torchtitan_rl.controller.hosts.squeue_json import (
    SlurmJsonError,
    expand_hostlist,
    job_info,
)

SAMPLES = pathlib.Path(__file__).parent / "slurm_json"


def _read(name: str) -> str:
    return (SAMPLES / name).read_text()


@pytest.mark.parametrize("sample, job_id, nodes", [
    ("squeue_22.05.json", "1", ["node1", "node2"]),
    ("squeue_23.02.json", "12", ["gpu07", "gpu08"]),
    ("squeue_24.11.json", "31", ["h100-061", "h100-089"]),
])
def test_a_running_job_reads_the_same_in_every_slurm_version(sample, job_id, nodes):
    assert job_info(_read(sample), job_id) == {
        "job_id": job_id, "job_state": ["RUNNING"],
        "job_resources": {"nodes": {"allocation": [{"name": n} for n in nodes]}}}


def test_slurm_22_05_lists_every_job_and_the_asked_one_is_picked():
    """22.05's --json ignores --job: Monarch took jobs[0] (here a COMPLETED job) and failed."""
    text = _read("squeue_22.05.json")
    assert json.loads(text)["jobs"][0]["job_state"] == "COMPLETED"
    assert job_info(text, "7")["job_state"] == ["COMPLETED"]
    assert job_info(text, "1")["job_state"] == ["RUNNING"]
    assert job_info(text, "9") == {"job_id": "9", "job_state": ["PENDING"],
                                   "job_resources": {"nodes": {"allocation": []}}}
    assert job_info(text, "404") is None


def test_the_host_list_is_read_where_no_node_list_is_given():
    data = json.loads(_read("squeue_22.05.json"))
    running = data["jobs"][1]
    del running["job_resources"]["allocated_nodes"]
    assert job_info(json.dumps(data), "1")["job_resources"]["nodes"]["allocation"] == [
        {"name": "node1"}, {"name": "node2"}]


@pytest.mark.parametrize("hostlist, names", [
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("a1,node[1-2,07],b", ["a1", "node1", "node2", "node07", "b"]),
    ("h100-[061,089]", ["h100-061", "h100-089"]),
    ("single", ["single"]),
])
def test_slurm_host_lists_expand(hostlist, names):
    assert expand_hostlist(hostlist) == names


def test_a_shape_of_no_known_version_is_one_line_naming_the_version():
    data = json.loads(_read("squeue_22.05.json"))
    data["jobs"][1]["job_state"] = {"current": "RUNNING"}
    with pytest.raises(SlurmJsonError, match=r"^squeue --json of Slurm 22\.05\.8: job 1's "
                                             r"job_state is \{'current': 'RUNNING'\}"):
        job_info(json.dumps(data), "1")
    data = json.loads(_read("squeue_24.11.json"))
    data["jobs"] = {"31": data["jobs"][0]}
    with pytest.raises(SlurmJsonError, match=r"^squeue --json of Slurm 24\.11\.5 has no 'jobs' "
                                             r"list"):
        job_info(json.dumps(data), "31")
    with pytest.raises(SlurmJsonError, match="printed no JSON"):
        job_info("squeue: error: invalid option", "1")
