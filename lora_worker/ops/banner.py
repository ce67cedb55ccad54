"""`lora-worker config`: where the settings came from, what they say, and what to try next.

`make run` prints it before gunicorn starts, so a newcomer sees which file (if any) and which variables
shaped the server, and the first few things to do with it.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from lora_worker.config import ENV_PREFIX, Settings
from lora_worker.errors import ConfigError
from lora_worker.host.bind import is_loopback

CREDENTIAL = Path("api_token")  # the unit's LoadCredential= name, inside $CREDENTIALS_DIRECTORY


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    config = sub.add_parser("config", help="where the settings came from, what they say, what to try next")
    config.add_argument("--bind", default=None, help="the address gunicorn is told on its command line, if any")


def sources(environ: Mapping[str, str]) -> list[str]:
    """The layers that made the settings, in the order they apply."""
    layers = ["built-in defaults (lora_worker/config.py)"]
    if environ.get(ENV_PREFIX + "CONFIG"):
        layers.append(f"the file {environ[ENV_PREFIX + 'CONFIG']} (LORA_WORKER_CONFIG)")
    names = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in (ENV_PREFIX + "CONFIG",
                                                                                  ENV_PREFIX + "SETTINGS"))
    if names:
        layers.append("the environment: " + ", ".join(names))
    return layers


def describe(settings: Settings, out: TextIO, environ: Mapping[str, str] | None = None,
             bind: str | None = None) -> None:
    environ = os.environ if environ is None else environ
    bind = bind or settings.bind
    token = _token_source(settings, environ)
    out.write("lora-worker settings, from " + "; then ".join(sources(environ)) + "\n")
    rows = {
        "listens on": bind + ("" if token else " (no API token: development mode, loopback only)"),
        "API token": token or "none",
        "state dir": f"{settings.state_dir} (ledger, locks, run logs)",
        "train root": str(settings.train_root),
        "models": ", ".join(map(str, settings.model_dirs)),
        "trainer": (f"{settings.trainer_kind}: {settings.accelerate}, {settings.sd_scripts_dir}"
                    + (" (the test double: trains nothing)" if settings.simulated else "")),
        "GPUs": f"simulated by {settings.nvml_fake_file}" if settings.nvml_fake_file else "NVML (the NVIDIA driver)",
    }
    for name, value in rows.items():
        out.write(f"  {name + ':':<12} {value}\n")
    url = f"http://{_loopback(bind)}"
    steps = [(f"curl -s {url}/healthz", "is it up, and which trainer does it run"),
             (".venv/bin/lora-worker doctor", "what this host lacks for a real training"),
             ("make demo", "no GPU? watch one job train on a simulated host"),
             ("README.md, 'First steps'", "a POST /train body, a poll, a cancel")]
    width = max(len(command) for command, _ in steps)
    out.write("next:\n" + "".join(f"  {command:<{width}}  # {why}\n" for command, why in steps))
    if not settings.simulated and not settings.train_script.is_file():
        out.write(f"  (no sd-scripts at {settings.sd_scripts_dir} yet: point accelerate, sd_scripts_dir and "
                  "tokenizer_cache_dir at a real install; until then every POST /train is a 503)\n")


def refuse_open_bind(settings: Settings, bind: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Without a token the worker serves loopback only (the web refuses anything else at start-up, in a
    traceback from gunicorn): say so in one line before anything starts."""
    bind = bind or settings.bind
    if _token_source(settings, os.environ if environ is None else environ) is None and not is_loopback(bind):
        raise ConfigError(f"no API token, and {bind} is not loopback: without a token the worker serves only "
                          "127.0.0.1; set api_token_file (or LORA_WORKER_API_TOKEN_FILE) to a token file, or bind "
                          "to 127.0.0.1:PORT")


def _token_source(settings: Settings, environ: Mapping[str, str]) -> str | None:
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if credentials and (Path(credentials) / CREDENTIAL).is_file():
        return f"the systemd credential {Path(credentials) / CREDENTIAL}"
    return f"the file {settings.api_token_file}" if settings.api_token_file else None


def _loopback(bind: str) -> str:
    first = bind.split(",")[0].strip()
    return first.replace("0.0.0.0", "127.0.0.1", 1) if not first.startswith("unix:") else first
