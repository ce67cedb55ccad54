"""The real service for tests: gunicorn with the shipped config, on a free loopback port, configured by env."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import psutil

from lora_worker.config import REPO_ROOT, Settings

SCALARS = {"str", "int", "float", "bool", "Path", "Path | None"}


def settings_env(settings: Settings) -> dict[str, str]:
    env = {}
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if value is None or str(f.type) not in SCALARS and f.name != "model_dirs":
            continue
        env[f"LORA_WORKER_{f.name.upper()}"] = (os.pathsep.join(map(str, value)) if f.name == "model_dirs"
                                                 else str(value))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """gunicorn running lora_worker.wsgi:app, as `make run` starts it."""

    def __init__(self, settings: Settings, log: Path, extra_env: dict[str, str] | None = None,
                 listen: str = "127.0.0.1") -> None:
        self.settings = settings
        self.listen = listen  # the address gunicorn binds; requests always go to loopback
        self.port = free_port()
        self.log = log
        self.env = {**os.environ, **settings_env(settings), **(extra_env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        gunicorn = str(Path(sys.executable).parent / "gunicorn")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [gunicorn, "-c", str(REPO_ROOT / "systemd" / "gunicorn.conf.py"), "--bind",
                 f"{self.listen}:{self.port}", "lora_worker.wsgi:app"],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/healthz")[0] == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn did not answer: {self.log.read_text()[-3000:]}")

    def workers(self) -> list[int]:
        assert self.proc is not None
        return [c.pid for c in psutil.Process(self.proc.pid).children()]

    def kill_9(self) -> None:
        """SIGKILL the master and its worker at once: a crash, not a shutdown."""
        assert self.proc is not None
        for pid in [self.proc.pid, *self.workers()]:
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 30) -> tuple[int, Any, dict[str, str]]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None, dict(resp.headers)
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
            return err.code, parsed, dict(err.headers)


def timed(svc: Service, method: str, path: str, **kwargs) -> tuple[int, float]:
    started = time.monotonic()
    code, _, _ = svc.request(method, path, timeout=10, **kwargs)
    return code, time.monotonic() - started
