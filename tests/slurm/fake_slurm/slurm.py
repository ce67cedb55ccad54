"""A fake Slurm on this host, as command-line tools (sbatch, squeue, sacct, scancel; scontrol ping, sinfo and srun for
the deep health check), for tests of the whole
path (HTTP → sbatch → node → poller process → ledger) where no real Slurm is installed. It is not Slurm: one
"node" (this host), no queue (every job starts at once, unless a `hold` file beside the tools keeps new jobs
PENDING, reason Resources, for as long as it is there), a job's processes are its session. It prints what
Slurm 22.05 prints in the formats the worker asks for. Real-cluster tests are elsewhere.

Every tool is this file, called by its name (a link); its state lives in `state/` beside it.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATE = HERE / "state"


def option(args, name, default=None):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


def record(job_id):
    path = STATE / f"{job_id}.json"
    return json.loads(path.read_text()) if path.exists() else None


def sbatch(args):
    """`sbatch [options] script [args]`. A `trouble` file beside the tools makes it queue the job, then fail as
    an sbatch whose answer was lost does: `fail` (exit 1 after the job was queued) or `hang` (never answer)."""
    STATE.mkdir(exist_ok=True)
    counter = STATE / "next_id"
    job_id = int(counter.read_text()) if counter.exists() else 100
    counter.write_text(str(job_id + 1))
    at = next(i for i, a in enumerate(args) if not a.startswith("--"))
    options, script, script_args, output = args[:at], args[at], args[at + 1:], option(args, "output")
    held = (HERE / "hold").exists()
    (STATE / f"{job_id}.json").write_text(json.dumps({"state": "PENDING" if held else "RUNNING", "options": options,
                                                      "name": option(options, "job-name"),
                                                      "reason": "Resources" if held else "None"}))
    env = {**os.environ, "SLURM_JOB_ID": str(job_id), "CUDA_VISIBLE_DEVICES": "0"}
    subprocess.Popen([sys.executable, str(HERE / "slurm.py"), "node", str(job_id), output, script, *script_args],  # noqa: S603
                     env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)  # sbatch returns at once; the job lives on
    trouble = troubled()
    if trouble in ("fail", "fail-blind"):
        print("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    if trouble == "hang":
        time.sleep(3600)
    print(job_id)
    return 0


def node(job_id, output, script, *script_args):
    """The job's life on the node: pending while the `hold` file is there (a plain scancel ends it so, and it
    never runs), then the batch script with its output into --output, then its ending."""
    while (rec := record(job_id))["state"] == "PENDING":
        if not (HERE / "hold").exists():
            rec.update(state="RUNNING", reason="None")
            (STATE / f"{job_id}.json").write_text(json.dumps(rec))
        time.sleep(0.05)
    if rec["state"] != "RUNNING":
        return 0
    with open(output, "ab") as out:  # the job's own session: what scancel --full signals, not this process
        proc = subprocess.Popen([script, *script_args], stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                                start_new_session=True)
    rec = record(job_id)
    rec["pgid"] = proc.pid
    (STATE / f"{job_id}.json").write_text(json.dumps(rec))
    rc = proc.wait()
    rec = record(job_id)
    cancelled = (STATE / f"{job_id}.cancelled").exists()
    rec["state"] = "CANCELLED" if cancelled else "COMPLETED" if rc == 0 else "FAILED"
    rec["exit"] = f"0:{-rc}" if rc < 0 else f"{min(rc, 255) & 0x7f}:0"
    (STATE / f"{job_id}.json").write_text(json.dumps(rec))
    return 0


def ids_of(args):
    return [i for i in (option(args, "jobs") or "").split(",") if i]


def troubled():
    """What the `trouble` file beside the tools says: `fail`, `hang`, or `fail-blind` (sbatch fails after
    queueing, and squeue and sacct cannot answer either: only scancel works)."""
    return (HERE / "trouble").read_text().strip() if (HERE / "trouble").exists() else ""


def named(args):
    name = option(args, "name")
    if name is None:
        return ids_of(args)
    return sorted(p.stem for p in STATE.glob("*.json") if p.stem.isdigit() and record(p.stem).get("name") == name)


def squeue(args):
    if troubled() == "fail-blind":
        print("squeue: error: Unable to contact slurm controller (connect failure)", file=sys.stderr)
        return 1
    for job_id in named(args):
        rec = record(job_id)
        if rec is not None:
            print(f"{job_id}|{rec['state']}|{rec.get('reason', 'None')}")
    return 0


def sacct(args):
    if troubled() == "fail-blind":
        print("sacct: error: Problem talking to the database: Connection refused", file=sys.stderr)
        return 1
    for job_id in ids_of(args):
        rec = record(job_id)
        if rec is not None:
            state = "CANCELLED by 0" if rec["state"] == "CANCELLED" else rec["state"]
            print(f"{job_id}|{state}|{rec.get('exit', '0:0')}|None")
    return 0


def scancel(args):
    if option(args, "name") is not None:
        for job_id in named(args):
            cancel(args, job_id)
        return 0
    return cancel(args, args[-1])


def cancel(args, job_id):
    rec = record(job_id)
    if rec is not None and rec["state"] == "PENDING" and option(args, "signal") is None:
        rec.update(state="CANCELLED", reason="None", exit="0:0")
        (STATE / f"{job_id}.json").write_text(json.dumps(rec))
        return 0
    if rec is None or rec["state"] != "RUNNING":
        return 0
    (STATE / f"{job_id}.cancelled").touch()
    sig = getattr(signal, "SIG" + option(args, "signal", "KILL"))
    while "pgid" not in (rec := record(job_id)):
        time.sleep(0.01)
    try:
        os.killpg(rec["pgid"], sig)  # --full: every process of the job's session, the batch script included
    except ProcessLookupError:
        pass
    return 0


def scontrol(args):
    """Only `scontrol ping`: the controller is UP unless the tools are `fail-blind` (then DOWN, exit 1)."""
    if args[:1] != ["ping"]:
        print(f"scontrol: error: the fake answers only `ping`, not {args[:2]}", file=sys.stderr)
        return 1
    if troubled() == "fail-blind":
        print("Slurmctld(primary) at fakectl is DOWN")
        return 1
    print("Slurmctld(primary) at fakectl is UP")
    return 0


def sinfo(args):
    """`sinfo --noheader --Node --partition=P --format=%N|%T|%G|%f`: the lines of the `nodes` file beside the tools
    (as sinfo prints them), else one idle node with two fake GPUs."""
    if troubled() == "fail-blind":
        print("sinfo: error: Unable to contact slurm controller (connect failure)", file=sys.stderr)
        return 1
    nodes = HERE / "nodes"
    print(nodes.read_text().strip() if nodes.exists() else "fakenode|idle|gpu:fake:2|(null)")
    return 0


def srun(args):
    """`srun [options] command…`: the command here, at once, as the one node with a GPU Slurm allocated it; or, with
    `busy` in the `trouble` file, what srun --immediate says when no node is free in time."""
    if troubled() == "busy":
        print("srun: error: Unable to allocate resources: Requested nodes are busy", file=sys.stderr)
        return 1
    command = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]  # the options end at the command
    env = {**os.environ, "SLURM_JOB_ID": "99", "CUDA_VISIBLE_DEVICES": "0"}
    return subprocess.run(command, env=env, stdin=subprocess.DEVNULL, check=False).returncode  # noqa: S603


TOOLS = {"sbatch": sbatch, "squeue": squeue, "sacct": sacct, "scancel": scancel, "scontrol": scontrol, "sinfo": sinfo,
         "srun": srun}


if __name__ == "__main__":
    name = Path(sys.argv[0]).name
    if name == "slurm.py" and sys.argv[1] == "node":
        sys.exit(node(*sys.argv[2:]))
    sys.exit(TOOLS[name](sys.argv[1:]))
