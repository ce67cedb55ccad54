"""deploy/requirements.lock: every dependency, transitive ones included, pinned with hashes, and agreeing with the
pins of setup.cfg, so two installs of one commit are the same."""
from __future__ import annotations

import configparser
import tomllib

from lora_worker.config import REPO_ROOT
from tests.helpers.deploy import LOCK, canonical, lock_entries, locked_pins


def setup_cfg_pins() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    pins = {}
    for line in config["options"]["install_requires"].strip().splitlines():
        name, version = line.strip().split("==")
        pins[canonical(name)] = version
    return pins


def test_the_lock_pins_every_install_requires_of_setup_cfg_at_the_same_version():
    pins = setup_cfg_pins()
    assert len(pins) >= 10
    assert {name: locked_pins().get(name) for name in pins} == pins


def test_every_locked_package_has_a_hash_and_nothing_is_unpinned():
    entries = lock_entries()
    assert all(hashes for _, hashes in entries.values()), [n for n, (_, h) in entries.items() if not h]
    requirement_lines = [line for line in LOCK.read_text().splitlines() if line and line[0] not in "# "]
    assert len(requirement_lines) == len(entries)  # every requirement line is a name==version entry


def test_the_lock_holds_transitive_dependencies_and_the_build_backend():
    locked = locked_pins()
    assert {"jinja2", "markupsafe", "click", "itsdangerous", "blinker", "mako"} <= set(locked)  # flask's, alembic's
    build = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert build == ["setuptools>=69"] and int(locked["setuptools"].split(".")[0]) >= 69
