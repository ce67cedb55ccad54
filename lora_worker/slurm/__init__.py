"""The Slurm backend (settings.backend = "slurm"): a job is an `sbatch` of its stored argv, and one poller
process follows every such job from the scheduler's answers and the job's own log on shared storage.

- `scheduler.py`: thin wrappers over sbatch, squeue, sacct, scontrol and scancel, and their parsing;
- `sbatch.py`: the generated batch script and the submission (flags, the job's files, a lost sbatch answer);
  on the node the script runs `python -m lora_worker.run.node` (the pre-exec look and the sandbox);
- `states.py`: Slurm's states mapped onto the ledger's (pure; the reference's state table, row by row);
- `poller.py`: one cycle over every active Slurm row (queued/running, progress, cancel, the end);
- `process.py` + `__main__.py`: the detached poller process, held by `<state>/locks/slurm-poller.lock`;
- `backend.py`: `SlurmBackend`, what dispatch and reconcile see (backends.py picks it);
- `health.py`: the deep health check of the cluster (the controller, usable nodes for each tier, the opt-in probe
  job that runs the trainer probe on a node).

The interface others rely on (the real-cluster tests, doctor, docs/slurm.md):
- settings (config.py, each also `LORA_WORKER_<NAME>`; the two tables as JSON there): `backend`
  ("local" | "slurm"), `max_active_jobs` (8), `slurm_partition` ("gpu"), `slurm_log_dir` (<state>/slurm),
  `slurm_bin_dir` (unset: PATH), `slurm_time_limit_min` and `slurm_mem_mb` (tier -> minutes / MB),
  `slurm_resources` (tier -> gres, constraint, train_batch_size, mixed_precision; config_slurm.py),
  `slurm_poll_interval_s` (2.0), `slurm_probe_job` (false); `backend = "slurm"` validates them at start-up;
- `python -m lora_worker.slurm`: the poller (settings from LORA_WORKER_SETTINGS, as the supervisor);
  `process.ensure_poller(settings)` starts it unless one holds the lock; dispatch calls it after each sbatch,
  and `SlurmBackend.attended` whenever reconcile asks after a Slurm row;
- the files under slurm_log_dir, each created O_EXCL|O_NOFOLLOW: `<id>.sbatch` (the script), `<id>.job.json`
  (its spec), `<id>.log` (--output, made empty by the worker), `<id>.rc` (the trainer's Popen return code),
  `<id>.refused` (why the node did not start the trainer: `launch_error`);
- the job name `lora-<id>-<8 hex of the state dir>` (sbatch.job_name), unique on the cluster;
- the row: `backend`, `slurm_job_id`, `queue_reason` (GET /train/<id> shows all three), slot `slurm-<k>`;
  events by actor "slurm"; the failure classes out_of_memory, time_limit, node_fail, slurm_lost;
- a cancel: the API flags the row (a queued Slurm row too); the poller scancels; `cancelled` once Slurm
  says the job ended.
"""

NAME = "slurm"  # the ledger's `backend` of a Slurm row, and the setting that asks for one
