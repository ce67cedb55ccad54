"""The GPU check (issue #35): the worker proved on a real GPU in one command under ten minutes, rehearsed on the
CPU rig.

`make gpu-check` (on a GPU machine: bench/gpu_check/device.sh, after `make gpu-bundle` here) runs, in order:

1. NVML through the worker's own binding (lora_worker/host/nvml.py: PynvmlBackend, each versioned process query on
   its own) held against `nvidia-smi`, device by device, while a CUDA process of the check's own holds 1 GiB
   (nvml_check.py);
2. a random-weight SDXL checkpoint built on the GPU (make_sdxl.py, the CPU rig's method with the init on CUDA);
3. the real worker: gunicorn with the shipped config (systemd/gunicorn.conf.py) serving the worker's app (wsgi.py),
   its start-up deep health check read from `GET /healthz?deep=1` (the sandbox with the real device nodes, the
   trainer's interpreter seeing CUDA inside it), then per run a job POSTed over HTTP and followed to its end: the
   detached supervisor, the bwrap sandbox and the real sd-scripts, a few dozen steps at 768 and at 1024 px, with
   and without a sample pass (runs.py, watch.py);
4. one table (table.py): seconds per step, the peak VRAM NVML saw, the pre-training phase and its parts, each
   sample pass's seconds and VRAM, the worker's CPU beside the trainer's; written as gpu-check.md and
   gpu-check.json, with the runs' logs in gpu-check-logs.tar.gz, into $OUT.

The run sizes (and a sampled run's sampler steps) come from the check's own Settings (`rig_tier_sizes`, which a
config file may not set and the environment never does), handed to gunicorn as a settings file (wsgi.py) and from
there to each supervisor, as every setting is; a sampled run asks for its prompt in the request's `samples`, as any
job does (dispatch/samples.py adds the sample flags). `--cpu` runs the same code on the CPU rig (../shared/rig) with
tiny sizes and a simulated card; tests/rig/test_gpu_check_rehearsal.py runs it so. Everything not measured is a row
saying why.
"""
