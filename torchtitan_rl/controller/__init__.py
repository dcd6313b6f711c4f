"""The single controller of a run: the job at this level, one subpackage per concern below it.

    job.py              RLJob: the config tree's root; resolve, run, restart, summary
    resolved_job.py     every part's config, derived and checked before anything spawns
    spawn.py            the meshes and every part the loop works with (RunParts)
    resume.py           a run goes on from a checkpoint (resume, or after a trainer restart)
    trainer_restart.py  a lost trainer rank: a new trainer mesh, restored from a checkpoint
    supervision.py      lost meshes: replaced (ReplaceableMeshes) or the run fails in one line
    torchrun.py         the torchrun launch (the trainer ranks are the torchrun processes)
    loop/  fleet/  hosts/  checkpoint/  rollout_workers/
"""
