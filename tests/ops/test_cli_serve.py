"""`lora-worker serve`: migrate, reconcile, then gunicorn with the shipped configuration."""
from __future__ import annotations

import os

import pytest

from lora_worker.errors import ConfigError
from lora_worker.ops import cli


@pytest.mark.parametrize("argv, bind", [([], []), (["--bind", "127.0.0.1:9000"], ["--bind", "127.0.0.1:9000"])])
def test_serve_passes_a_bind_only_when_given_so_the_setting_applies_otherwise(migrated, monkeypatch, argv, bind):
    execs = []
    monkeypatch.setattr(os, "execv", lambda path, args: execs.append(args))
    cli.cmd_serve(migrated, cli.build_parser().parse_args(["serve", *argv]))
    [args] = execs
    assert args[1:3] == ["-c", args[2]] and args[2].endswith("systemd/gunicorn.conf.py")
    assert args[3:-1] == bind and args[-1] == "lora_worker.wsgi:app"


def test_serve_on_an_open_bind_without_a_token_refuses_before_anything_starts(migrated, monkeypatch):
    execs = []
    monkeypatch.setattr(os, "execv", lambda path, args: execs.append(args))
    with pytest.raises(ConfigError, match="no API token, and 0.0.0.0:9000 is not loopback"):
        cli.cmd_serve(migrated, cli.build_parser().parse_args(["serve", "--bind", "0.0.0.0:9000"]))
    assert execs == []
