"""Where a run's processes live: placements (this host, simulated hosts, attached workers, Slurm,
Kubernetes), shared proc meshes, TLS to attached workers, and the reaper that leaves nothing
behind."""
