"""Fixtures: a fresh state dir, ledger and fake trainer installation per test; the app → client chain."""
from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lora_worker.config import Settings
from lora_worker.ledger.db import Database
from tests.helpers import Host, Launches, fuzz, make_host, shared_tokenizers, tokenizer_identities
from tests.helpers.ledger import migrated_ledger
from tests.helpers.processes import not_zombie, pids, processes_of, start_recorder
from tests.helpers.wakeup import start_listener

pytest_plugins = ["tests.webhooks.fixtures"]  # the webhook target: tests/webhooks and tests/chaos

fuzz.load_profile()  # the property tests' example budget: bounded, or what HYPOTHESIS_PROFILE names


@pytest.fixture(scope="session")
def _shared_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tokenizers(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture
def tokenizers(request: pytest.FixtureRequest, _shared_tokenizers: Path) -> Iterator[Path | None]:
    """The tokenizer cache for this test's hosts (`make_host(..., tokenizers=)`): the process's shared one, or
    None (each host writes its own) for a test marked `own_tokenizers` (it changes them). A test that changes the
    shared one unmarked fails, and the cache is written afresh."""
    if request.node.get_closest_marker("own_tokenizers"):
        yield None
        return
    before = tokenizer_identities(_shared_tokenizers)
    yield _shared_tokenizers
    if tokenizer_identities(_shared_tokenizers) != before:
        shutil.rmtree(_shared_tokenizers)
        shared_tokenizers(_shared_tokenizers)
        pytest.fail(f"{request.node.nodeid} changed the tokenizer cache every host of this process shares: mark it "
                    "@pytest.mark.own_tokenizers", pytrace=False)


@pytest.fixture
def host(tmp_path: Path, tokenizers: Path | None) -> Host:
    return make_host(tmp_path, tokenizers=tokenizers)


@pytest.fixture
def settings(host: Host) -> Settings:
    return host.settings


@pytest.fixture
def migrated(settings: Settings) -> Settings:
    migrated_ledger(settings.database_path)
    return settings


@pytest.fixture
def db(migrated: Settings):
    database = Database.open(migrated.database_path)
    yield database
    database.dispose()


@pytest.fixture
def app(migrated: Settings):
    from lora_worker import create_app

    application = create_app(migrated)
    application.config["TESTING"] = True
    yield application
    application.extensions["lora_worker"].db.dispose()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def launches() -> Launches:
    return Launches()


@pytest.fixture
def api(migrated: Settings, launches: Launches):
    """A client of an app whose supervisor launcher only records: validation and dispatch without processes."""
    from lora_worker import create_app

    application = create_app(migrated, launch=launches)
    yield application.test_client()
    application.extensions["lora_worker"].db.dispose()


@pytest.fixture
def listener():
    """A process that says "woken" on each wake-up signal it receives (tests/helpers/wakeup.py)."""
    with start_listener() as proc:  # closes its stdout
        yield proc
        proc.kill()


@pytest.fixture
def nvml(settings: Settings):
    from lora_worker.host.nvml import FakeNvml

    assert settings.nvml_fake_file is not None
    return FakeNvml.from_file(settings.nvml_fake_file)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches every process a test starts, however the suite was started. `make test` runs the cluster's
    tests as a background job (`&`) of a non-interactive shell, which starts it with SIGINT (and SIGQUIT) ignored
    (POSIX, "asynchronous lists"), and an ignored signal stays ignored across exec: the demo the cluster test
    stops with SIGINT never saw it. A handler of our own is reset to the default at each child's exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


# `make test-fast` (LW_TEST_FAST=1, `-m "not slow"`): the edit-test loop, without real processes. A test there that
# starts one anyway fails, naming itself, so the split stays true: mark it `slow`.
FAST = os.environ.get("LW_TEST_FAST") == "1"
# What starts a real cluster (tests/cluster, the Slurm benchmark's smoke test among them) runs in one process of
# its own (the Makefile's `test`): two clusters at once would each see the other's daemons as its own leftovers.
CLUSTER = Path(__file__).parent / "cluster"
# A module whose tests share a module-scoped fixture too costly to make once per worker: systemd/install.py's
# staged install builds a venv from the lock.
ONE_WORKER_MODULES = {Path(__file__).parent / "deploy" / "test_install.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-cluster tests run on one worker (`--dist loadgroup`), one after another, against the one
    session-scoped cluster, and so do the tests of each module in ONE_WORKER_MODULES; every other test may run
    on any worker at the same time. A property test marked fuzz that sets its own budget is refused."""
    marked = [(item.nodeid, item.obj) for item in items
              if isinstance(item, pytest.Function) and item.get_closest_marker(fuzz.MARKER)]
    if offences := fuzz.budget_offences(marked):
        raise pytest.UsageError("; ".join(offences))
    for item in items:
        path = Path(str(item.path))
        if CLUSTER in path.parents:
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif path in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(path.stem))


@pytest.fixture(autouse=True)
def _no_process_in_fast_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if not FAST:
        yield
        return
    started = start_recorder(monkeypatch)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} started a real process ({started[0]}) under make test-fast: mark it "
                    "@pytest.mark.slow", pytrace=False)


LEFTOVER_GRACE_S = 5.0  # a supervisor may still be closing its ledger just after it wrote the final state


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path: Path):
    """Every process a test started under its tmp dir is gone afterwards: one still alive after a short grace
    fails the test (a leaked trainer is a bug the test would otherwise hide), and is killed. Only the processes
    started while the test ran are looked at (a pid is not reused that soon: pid_max is in the millions), and
    each through /proc directly: psutil's walk over every process's environment cost 0.1 s a test."""
    before = pids()
    yield
    leftovers = processes_of(str(tmp_path), pids() - before)
    if leftovers:
        # Wait for each to exit, not to be reaped: a zombie is done, and its reaper (init, re-parented to) may
        # take seconds to collect it, which psutil.wait_procs would wait out.
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (alive := [p for p in leftovers if not_zombie(p)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        described = [_describe(p) for p in alive]
        for proc in alive:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if described:
            pytest.fail(f"processes left running by the test: {described}", pytrace=False)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)
