"""The contract of a job's life (tests/helpers/scenarios.py, run on the local supervisor and the fake Slurm by
tests/contract/test_job_life.py) on the real single-node cluster: the same expected ends, with sbatch, squeue,
sacct, scancel and slurmd's own signals. The scenarios that tell whether the fake Slurm stands for the real one
where the follower relies on it: a success, the NaN stop and the half LoRA set aside (`scancel --signal=TERM
--full` ends a job FAILED, not CANCELLED, on a real cluster), a cancel in saving, a crash."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.cluster import Cluster
from tests.helpers import Host
from tests.helpers import scenarios
from tests.helpers.life import Worker, start_worker
from tests.helpers.scenarios import Start
from tests.webhooks.receiver import Receiver, write_secrets

pytestmark = pytest.mark.slow


@pytest.fixture
def start(cluster: Cluster, host: Host, receiver: Receiver, secret: str, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # the poller the app starts inherits it
    made: list[Worker] = []

    def make(**overrides: object) -> Worker:
        made.append(start_worker("cluster", host, tmp_path, receiver.url,
                                 write_secrets(tmp_path / "webhook_secret", secret), cluster=cluster,
                                 **overrides))  # type: ignore[arg-type]
        return made[-1]
    yield make
    for worker in made:
        worker.close()


def test_a_run_ends_succeeded_with_its_verified_lora_and_its_states_dropped(start: Start):
    scenarios.success(start())


def test_a_loss_gone_nan_stops_the_run_and_fails_it_nan_loss(start: Start):
    scenarios.nan_loss(start())


def test_a_cancel_in_saving_ends_cancelled_and_sets_the_half_written_lora_aside(start: Start):
    scenarios.cancel_saving(start())


def test_a_save_that_never_finishes_leaves_its_partial_lora_aside_and_blocks_no_retry(start: Start):
    scenarios.save_never_ends(start(stall_limits_s={"saving": 2.0}))


def test_a_trainer_that_crashes_fails_with_the_class_its_output_explains(start: Start):
    scenarios.crash(start())
