"""The promises every chaos test checks: what must hold whatever was killed, and when."""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

TERMINAL = ("succeeded", "failed", "cancelled")


def integrity_ok(path: Path) -> bool:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()


def active_rows(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')").fetchone()[0]
    finally:
        conn.close()


def terminal_events(path: Path, job_id: int) -> list[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute("SELECT to_status FROM job_events WHERE job_id = ? AND to_status IN "
                            "('succeeded', 'failed', 'cancelled') ORDER BY id", (job_id,)).fetchall()
    finally:
        conn.close()
    return [r[0] for r in rows]


@dataclass
class Timeline:
    """What a client saw of one job, in order; checks that it never went backwards or moved after the end."""

    samples: list[tuple[str, int, int]] = field(default_factory=list)  # (status, step, version)

    def add(self, job: dict) -> None:
        self.samples.append((job["status"], job["step"], job["version"]))

    def problems(self) -> list[str]:
        found = []
        for (s0, step0, v0), (s1, step1, v1) in zip(self.samples, self.samples[1:]):
            if step1 < step0 or v1 < v0:
                found.append(f"went backwards: {(s0, step0, v0)} -> {(s1, step1, v1)}")
            if s0 in TERMINAL and (s1, step1, v1) != (s0, step0, v0):
                found.append(f"changed after the end: {(s0, step0, v0)} -> {(s1, step1, v1)}")
        return found


def processes_with_arg(arg: str) -> list[int]:
    """Live processes with `arg` as a whole argument: a job's launcher, trainer and forked workers carry its
    `--output_name=`, whether or not the trainer wrote its record before the supervisor died."""
    import psutil

    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and arg in (p.info["cmdline"] or ())]


def autopsy(path: Path, job_id: int, pids: list[int]) -> str:
    """What a failed check needs to name its cause: the job's row and events, and each of the given processes
    still alive with its /proc status and argv."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        row = conn.execute("SELECT status, phase, failure_class, error, supervisor_pid, trainer_pid, step "
                           "FROM jobs WHERE id = ?", (job_id,)).fetchone()
        events = conn.execute("SELECT at, from_status, to_status, actor, reason FROM job_events WHERE job_id = ? "
                              "ORDER BY id", (job_id,)).fetchall()
    finally:
        conn.close()
    lines = [f"job {job_id}: (status, phase, failure_class, error, supervisor_pid, trainer_pid, step) = {row}"]
    lines += [f"  event {e}" for e in events]
    for pid in pids:
        lines.append(f"  process {pid}: {_proc(pid)}")
    return "\n".join(lines)


def _proc(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    keep = [s for s in status if s.split(":")[0] in ("Name", "State", "Tgid", "PPid", "NSsid", "NSpgid")]
    fields_ = stat[stat.rfind(")") + 2:].split()
    return f"{'; '.join(keep)}; pgid {fields_[2]} sid {fields_[3]} start {fields_[19]}; argv {argv.strip()}"
