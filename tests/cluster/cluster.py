"""A single-node Slurm for the tests: munge, MariaDB + slurmdbd (sacct needs accounting), slurmctld and slurmd,
one partition `gpu` with two fake GPUs (empty files stand in for their device nodes), configured as
docs/reference/slurm.md records it working on a machine like ours.

Everything lives under one directory (`root`) and talks over a munge socket and loopback ports of its own, so
it never meets the machine's own munged or a real cluster's configuration: `SLURM_CONF` points every client at
it, and slurm.conf names the munge socket (`AuthInfo`). `stop()` ends every job and daemon it started and says
which processes are still alive after it (`leftovers()`), so a fixture can fail loudly instead of leaking one.

Needs root (slurmd runs jobs as their user, and SlurmUser=root), the Debian packages `slurmctld slurmd
slurm-client slurmdbd munge mariadb-server`, and a cgroup hierarchy (v1 or v2; the plugin follows what
/sys/fs/cgroup holds). It takes ~10-20 s to come up on 2 cores, mostly mariadb-install-db.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# What the bring-up runs; each must be installed for the tests to run (conftest.py skips naming the missing).
PROGRAMS = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "slurmdbd",
            "munged", "munge", "mariadbd", "mariadb-install-db", "mariadb")
DAEMONS = ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged")  # the order they stop in
# SlurmdTimeout: how long slurmctld waits for a silent slurmd before it declares the node DOWN (the lost-node
# test waits that long). The reference ran 15 s; 8 s keeps the test short and still outlasts a quick restart.
SLURMD_TIMEOUT_S = 8
KILL_WAIT_S = 5  # the cluster-wide grace between scancel's TERM and KILL (the reference's)
STORAGE_PASS = "lw-test-only"


def program(name: str) -> str | None:
    """Where `name` is: on PATH, or in /usr/sbin (often not on a test runner's PATH)."""
    found = shutil.which(name)
    if found:
        return found
    sbin = Path("/usr/sbin", name)
    return str(sbin) if sbin.exists() else None


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if program(name) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cgroup_plugin() -> str:
    return "cgroup/v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "cgroup/v1"


@dataclass
class Cluster:
    root: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    # A misconfigured cluster for doctor's tests: only slurmctld (and the munged of `munge_of`, another
    # cluster), proctrack/linuxproc, no GRES, no accounting, and the partition `gpu` down.
    misconfigured: bool = False
    munge_of: Cluster | None = None
    _mariadbd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    # -- where things are ----------------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.munge_of.munge_socket if self.munge_of else self.root / "run" / "munge.sock"

    @property
    def shared(self) -> Path:
        """Storage both the node and the worker see (here: the same disk): job logs and rc files go here."""
        return self.root / "shared"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def bin_dir(self) -> Path:
        """Where the client commands are (what the worker's slurm_bin_dir names)."""
        sbatch = program("sbatch")
        assert sbatch is not None
        return Path(sbatch).parent

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A client command against this cluster."""
        exe = program(argv[0]) or argv[0]
        return subprocess.run([exe, *argv[1:]], env={**os.environ, **self.env}, capture_output=True, text=True,
                              check=check, timeout=timeout)

    # -- configuration -------------------------------------------------------------------------------------

    def write_config(self) -> None:
        for sub in ("etc", "spool/ctld", "spool/d", "log", "dev", "db", "run", "lib", "shared"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged checks its socket's directory and every one above it: all may enter, none but root may write.
        self.root.chmod(0o755)
        (self.root / "run").chmod(0o755)
        for i in (0, 1):
            _fake_device(self.root / "dev" / f"fakegpu{i}")
        self.ports = {name: _free_port() for name in ("mariadb", "dbd", "ctld", "d")}
        r, n, p = self.root, self.node, self.ports
        if self.misconfigured:
            self.conf.write_text(self._misconfiguration())
            return
        self.conf.write_text(f"""\
ClusterName=lwtest
SlurmctldHost={n}
SlurmctldPort={p['ctld']}
SlurmdPort={p['d']}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/spool/ctld
SlurmdSpoolDir={r}/spool/d
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={p['dbd']}
AccountingStorageTRES=gres/gpu
# The munge socket for slurmdbd's connections (AuthInfo covers the others): slurm.conf(5) names it so.
AccountingStoragePass={self.munge_socket}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=1
KillWait={KILL_WAIT_S}
MinJobAge=300
ReturnToService=2
SchedulerType=sched/backfill
SlurmdTimeout={SLURMD_TIMEOUT_S}
NodeName={n} CPUs={os.cpu_count() or 2} RealMemory=8000 Gres=gpu:fake:2 State=UNKNOWN
PartitionName=gpu Nodes={n} Default=YES MaxTime=INFINITE State=UP
""")
        (r / "etc" / "cgroup.conf").write_text(f"CgroupPlugin={_cgroup_plugin()}\nCgroupMountpoint=/sys/fs/cgroup\n"
                                              "ConstrainRAMSpace=yes\n")
        (r / "etc" / "gres.conf").write_text(f"NodeName={n} Name=gpu Type=fake File={r}/dev/fakegpu[0-1]\n")
        dbd = r / "etc" / "slurmdbd.conf"
        dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdPort={p['dbd']}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={p['mariadb']}
StorageUser=slurm
StoragePass={STORAGE_PASS}
StorageLoc=slurm_acct_db
PidFile={r}/run/slurmdbd.pid
LogFile={r}/log/slurmdbd.log
""")
        dbd.chmod(0o600)  # slurmdbd refuses a configuration others can read

    def _misconfiguration(self) -> str:
        r, n, p = self.root, self.node, self.ports
        return f"""\
ClusterName=lwbroken
SlurmctldHost={n}
SlurmctldPort={p['ctld']}
SlurmdPort={p['d']}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/spool/ctld
SlurmdSpoolDir={r}/spool/d
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmctldLogFile={r}/log/slurmctld.log
ProctrackType=proctrack/linuxproc
SelectType=select/cons_tres
AccountingStorageType=accounting_storage/none
NodeName={n} CPUs={os.cpu_count() or 2} RealMemory=8000 State=UNKNOWN
PartitionName=gpu Nodes={n} Default=YES MaxTime=INFINITE State=DOWN
PartitionName=debug Nodes={n} MaxTime=INFINITE State=UP
"""

    # -- daemons -------------------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Bring every daemon up and wait for the node to be idle; on any failure, stop what did start."""
        try:
            self.write_config()
            if self.misconfigured:
                self._daemon("slurmctld", "slurmctld.pid")
                _wait(lambda: self.run("sinfo", check=False).returncode == 0, 30, "slurmctld")
                return self
            self._start_munge()
            self._start_mariadb()
            self._daemon("slurmdbd", "slurmdbd.pid", ready=lambda: "slurmdbd version" in self.log("slurmdbd.log"))
            self._daemon("slurmctld", "slurmctld.pid")
            self.start_slurmd()
            self.wait_node("idle", timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def start_slurmd(self) -> None:
        self.start_daemon("slurmd")

    def stop_slurmd(self, sig: int = signal.SIGTERM) -> None:
        self.stop_daemon("slurmd", sig)

    def start_daemon(self, name: str) -> None:
        """slurmd or slurmctld, again after a stop."""
        self._daemon(name, f"{name}.pid")

    def stop_daemon(self, name: str, sig: int = signal.SIGTERM) -> None:
        """TERM: a clean stop (running jobs carry on under their slurmstepd); KILL of slurmd: the node is lost."""
        pid = self.pids.pop(name, None)
        if pid:
            _kill_and_wait(pid, sig)
        (self.root / "run" / f"{name}.pid").unlink(missing_ok=True)

    def _start_munge(self) -> None:
        key = self.root / "etc" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self._daemon("munged", "munged.pid", argv=[
            f"--socket={self.munge_socket}", f"--key-file={key}", f"--pid-file={self.root}/run/munged.pid",
            f"--log-file={self.root}/log/munged.log", f"--seed-file={self.root}/lib/munged.seed"])
        socket_arg = f"--socket={self.munge_socket}"
        _wait(lambda: subprocess.run(f"{program('munge')} {socket_arg} -n | {program('unmunge')} {socket_arg}",
                                     shell=True, capture_output=True).returncode == 0,  # noqa: S602
              10, "munged")

    def _start_mariadb(self) -> None:
        r = self.root
        subprocess.run([program("mariadb-install-db"), "--user=root", f"--datadir={r}/db",
                        "--auth-root-authentication-method=socket", "--skip-test-db"],
                       check=True, capture_output=True, timeout=180)
        with (r / "log" / "mariadb.log").open("ab") as out:
            proc = subprocess.Popen(
                [program("mariadbd"), "--no-defaults", "--user=root", f"--datadir={r}/db",
                 f"--socket={r}/run/mysqld.sock", f"--port={self.ports['mariadb']}", "--bind-address=127.0.0.1",
                 f"--pid-file={r}/run/mariadb.pid", "--skip-log-bin", "--innodb-buffer-pool-size=32M"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pids["mariadbd"] = proc.pid
        self._mariadbd = proc  # ours to reap once stopped
        sql = ("CREATE DATABASE IF NOT EXISTS slurm_acct_db; "
               f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{STORAGE_PASS}'; "
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;")

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited {proc.returncode}: {self.log('mariadb.log')[-2000:]}")
            return subprocess.run([program("mariadb"), "--no-defaults", f"--socket={r}/run/mysqld.sock", "-uroot",
                                   "-e", sql], capture_output=True).returncode == 0
        _wait(ready, 90, "mariadbd")

    def _daemon(self, name: str, pidfile: str, ready: Callable[[], bool] | None = None,
                argv: list[str] | None = None) -> None:
        """Start a daemon that forks itself into the background and writes a pid file."""
        path = self.root / "run" / pidfile
        path.unlink(missing_ok=True)
        done = subprocess.run([program(name), *(argv or [])], env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"{name} did not start ({done.returncode}): {done.stderr[-2000:]}")
        _wait(lambda: path.exists() and path.read_text().strip() != "", 30, f"{name}'s pid file")
        self.pids[name] = int(path.read_text().split()[0])
        if ready is not None:
            _wait(ready, 60, name)

    def log(self, name: str) -> str:
        path = self.root / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_node(self, *states: str, timeout: float) -> None:
        """Until the node is in one of `states` and responding (sinfo adds `*` while slurmd is silent)."""
        seen: list[str] = []

        def there() -> bool:
            seen.append(self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip())
            return seen[-1] in states
        try:
            _wait(there, timeout, f"node {'/'.join(states)}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} (it says {seen[-1:]}; slurmd's log ends: "
                               f"{self.log('slurmd.log')[-800:]})") from exc

    def resume_node(self) -> None:
        """After a lost node: back to service (ReturnToService=2 does it once slurmd registers; this is sure)."""
        self.run("scontrol", "update", f"NodeName={self.node}", "State=RESUME", check=False)

    # -- the end -------------------------------------------------------------------------------------------

    def stop(self) -> None:
        # Jobs first, so no trainer outlives the cluster; then the daemons, the node first.
        if "slurmctld" in self.pids:
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
            self.run("scancel", "--user=root", check=False)
            _wait_quietly(lambda: not self.run("squeue", "-h", "-t", "all", "-o", "%i", check=False).stdout.strip()
                          or not self._stepsalive(), 20)
        for name in DAEMONS:
            pid = self.pids.pop(name, None)
            if pid:
                _kill_and_wait(pid, signal.SIGTERM)
        for pid in self.leftovers():  # a slurmstepd whose job outlived its slurmd, or a daemon that forked twice
            _kill_and_wait(pid, signal.SIGKILL, timeout=5)
        if self._mariadbd is not None:
            self._mariadbd.wait(timeout=30)
            self._mariadbd = None

    def _stepsalive(self) -> bool:
        return any("slurmstepd" in _cmdline(pid) for pid in self.leftovers())

    def leftovers(self) -> list[int]:
        """Every live process of this cluster: a daemon, a slurmstepd or a job's process. Found by what marks
        them (the root in their command line, SLURM_CONF in their environment), never by a name alone, so a
        machine's own Slurm or munged is never counted or killed."""
        marker, conf = str(self.root), f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                environ = b""
            if (marker in _cmdline(pid) or conf in environ.split(b"\0")) and alive(pid):
                found.append(pid)
        return found


def _fake_device(path: Path) -> None:
    """A stand-in for a GPU's device node. slurmd wants a character device (else it logs an error and sets no
    CUDA_VISIBLE_DEVICES): a copy of /dev/null's numbers, where mknod is allowed; a plain file otherwise."""
    path.unlink(missing_ok=True)
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        path.touch()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running, not a zombie: the daemons fork away from us, and their reaper may take a while."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return line[line.rfind(")") + 2] not in "ZX"


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"the test cluster's {what} did not come up in {timeout:g}s")


def _wait_quietly(predicate: Callable[[], object], timeout: float) -> None:
    try:
        _wait(predicate, timeout, "")
    except TimeoutError:
        pass


def _kill_and_wait(pid: int, sig: int, timeout: float = 20.0) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- `make demo-slurm` -----------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """`python -m tests.cluster.cluster COMMAND…`: run COMMAND (the demo) with a worker's Slurm settings pointing at
    a fresh single-node cluster, then stop the cluster and everything it ran. Ctrl-C goes to COMMAND."""
    import json
    import tempfile

    if not argv:
        print("usage: python -m tests.cluster.cluster COMMAND [ARG…]", file=sys.stderr)
        return 2
    missing = missing_programs()
    if missing or os.geteuid() != 0:
        print("a single-node Slurm needs root and " + (", ".join(missing) or "nothing more") + " (apt-get install "
              "slurmctld slurmd slurm-client slurmdbd munge mariadb-server)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="lw-slurm-", dir="/tmp"))
    cluster = Cluster(root).start()
    env = {**os.environ, **cluster.env, "LORA_WORKER_BACKEND": "slurm",
           "LORA_WORKER_SLURM_BIN_DIR": str(cluster.bin_dir),
           "LORA_WORKER_SLURM_MEM_MB": json.dumps({t: 2000 for t in ("fast", "balanced", "quality")})}
    print(f"single-node Slurm up (2 fake GPUs): SLURM_CONF={cluster.conf}", flush=True)
    # A handler, not SIG_IGN (which the command would inherit): Ctrl-C is the command's, the cluster ours.
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        return subprocess.run(argv, env=env, check=False).returncode
    finally:
        cluster.stop()
        signal.signal(signal.SIGINT, previous)
        if not cluster.leftovers():
            shutil.rmtree(root, ignore_errors=True)
        print("single-node Slurm stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
