"""The processes a test left behind (tests/conftest.py fails the test that leaves one): found by its tmp dir."""
from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Callable
from typing import Any

import psutil
import pytest


def pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def processes_of(marker: str, among: set[int]) -> list[psutil.Process]:
    """The processes among `among` (pids) whose command line, or LORA_WORKER_SETTINGS in whose environment, names
    `marker` (a test's tmp dir)."""
    needle, found = marker.encode(), []
    for pid in sorted(among - {os.getpid()}):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                ours = needle in fh.read()
            if not ours:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    ours = any(var.startswith(b"LORA_WORKER_SETTINGS=") and needle in var
                               for var in fh.read().split(b"\0"))
        except OSError:  # gone, or not ours to read
            continue
        if ours:
            try:
                found.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
    return [p for p in found if not_zombie(p)]


def not_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_recorder(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every way this process can start another (subprocess and multiprocessing go through fork_exec or
    posix_spawn; the supervisor's detach through fork), recorded by name in the list returned, and let through."""
    started: list[str] = []

    def recording(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started.append(name)
            return real(*args, **kwargs)
        return call

    for label, module, name in (("subprocess", subprocess, "_fork_exec"), ("multiprocessing", _posixsubprocess,
                                "fork_exec"), ("os.fork", os, "fork"), ("os.forkpty", os, "forkpty"),
                                ("os.posix_spawn", os, "posix_spawn"), ("os.posix_spawnp", os, "posix_spawnp")):
        monkeypatch.setattr(module, name, recording(label, getattr(module, name)))
    return started
