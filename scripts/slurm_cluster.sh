#!/usr/bin/env bash
# A real Slurm cluster on this machine (one slurmctld, N slurmd nodes): up | down | status |
# exec -- CMD | kill-node NAME | start-node NAME. Details: scripts/slurm_cluster.py, docs/scaling.md.
exec python3 "$(dirname "${BASH_SOURCE[0]}")/slurm_cluster.py" "$@"
