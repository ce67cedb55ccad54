"""The Slurm backend (settings.backend = "slurm"): a job is an `sbatch` of its stored argv, and one poller
process follows every such job from the scheduler's answers and the job's own log on shared storage.

- `scheduler.py`: thin wrappers over sbatch, squeue, sacct, scontrol and scancel, and their parsing;
- `sbatch.py`: the generated batch script and the submission (flags, log and exit-status files);
- `states.py`: Slurm's states mapped onto the ledger's (pure; the reference's state table, row by row);
- `poller.py`: one cycle over every active Slurm row (queued/running, progress, cancel, the end);
- `process.py` + `__main__.py`: the detached poller process, held by `<state>/locks/slurm-poller.lock`;
- `backend.py`: `SlurmBackend`, what dispatch and reconcile see (run/backend.py picks it).
"""
