"""The worker's service for the check: gunicorn with the shipped config (systemd/gunicorn.conf.py, as `make run`),
serving bench/gpu_check/wsgi.py's app on a free loopback port, and its HTTP API as the check's client.
"""
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
from pathlib import Path
from typing import Any

import psutil

from lora_worker.config import REPO_ROOT, Settings, settings_to_json

SETTINGS_FILE_ENV = "LW_GPU_CHECK_SETTINGS"  # the settings file wsgi.py builds the app from
DEEP_ENV = "LW_GPU_CHECK_DEEP"  # "0": this service skips the start-up deep checks (wsgi.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    def __init__(self, settings: Settings, work: Path, name: str, *, deep: bool = True) -> None:
        self.settings, self.deep = settings, deep
        self.port = free_port()
        self.log = work / f"gunicorn-{name}.log"
        self.settings_file = work / f"settings-{name}.json"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Service:
        self.settings_file.write_text(settings_to_json(self.settings))
        env = {**os.environ, SETTINGS_FILE_ENV: str(self.settings_file), DEEP_ENV: "1" if self.deep else "0"}
        env = {k: v for k, v in env.items() if not k.startswith("LORA_WORKER_")}  # the file says everything
        gunicorn = str(Path(sys.executable).parent / "gunicorn")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - a fixed argv
                [gunicorn, "-c", str(REPO_ROOT / "systemd" / "gunicorn.conf.py"), "--bind", f"127.0.0.1:{self.port}",
                 "bench.gpu_check.wsgi:app"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/healthz")[0] == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn did not answer in {timeout_s:g} s: {self.log.read_text()[-3000:]}")

    def deep_health(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """/healthz?deep=1 once the start-up checks have finished (`status` ok or failing), or the pending answer
        at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            code, body = self.request("GET", "/healthz?deep=1")
            deep = body.get("deep") or (body.get("details") or {}).get("deep") or {}
            if deep.get("status") not in (None, "pending") or time.monotonic() > deadline:
                return deep
            time.sleep(0.5)

    def processes(self) -> list[psutil.Process]:
        """gunicorn's master and its worker(s): the web side of the worker."""
        if self.proc is None:
            return []
        try:
            master = psutil.Process(self.proc.pid)
            return [master, *master.children(recursive=True)]
        except psutil.Error:
            return []

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def request(self, method: str, path: str, body: Any = None, timeout: float = 40.0) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own loopback service
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except ValueError:
                return err.code, {"error": raw.decode(errors="replace")}
