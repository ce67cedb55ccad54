"""The process a sender dies with, where one is named: the demo's sender ends with the demo, however it ends.

A sender is detached (a double fork, a session of its own) so that it outlives the web, as a deployed one
must (docs/webhooks.md). The demo must leave nothing behind, even when it is SIGKILLed with its whole process
group, which gives it no chance to stop the sender and reaches no process of another session. So the demo
names itself in the environment of the web it starts (`LIFELINE_ENV`: its pid and start time, which the web
hands on to the sender it starts), and the sender watches that process: once it is gone (or its pid belongs to
another process), the sender stops as on SIGTERM. The start time is what tells a reused pid from the demo.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import psutil

LIFELINE_ENV = "LORA_WORKER_WEBHOOKS_LIFELINE"


def lifeline_of(pid: int) -> str:
    """The value of `LIFELINE_ENV` that ties a sender to process `pid`."""
    return f"{pid}:{psutil.Process(pid).create_time()!r}"


class Lifeline:
    def __init__(self, pid: int, started: float) -> None:
        self.pid, self.started = pid, started

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Lifeline | None:
        """The process named in the environment; None if none is. A value that does not read is a process
        that is gone: a sender told to die with something must never outlive it by a typo."""
        raw = (os.environ if environ is None else environ).get(LIFELINE_ENV)
        if not raw:
            return None
        pid, _, started = raw.partition(":")
        try:
            return cls(int(pid), float(started))
        except ValueError:
            return cls(0, 0.0)

    def gone(self) -> bool:
        if self.pid <= 0:
            return True
        try:
            process = psutil.Process(self.pid)
            return process.create_time() != self.started or process.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True
