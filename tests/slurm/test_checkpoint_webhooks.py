"""`job.checkpoint` under Slurm: the poller records a step LoRA's verification with the progress, and its
webhook event with it; a poller started again re-reads the node's log from the start and sends none twice."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_worker.ledger import outbox
from lora_worker.webhooks.process import stop_sender
from tests.helpers import Host
from tests.helpers.fake_trainer import load_fake_trainer
from tests.slurm.fakes import SlurmWorker, close_worker, slurm_worker, steps_bar
from tests.webhooks.receiver import Receiver, write_secrets

pytestmark = pytest.mark.slow  # the web starts a webhook sender process
FAKE = load_fake_trainer()
PRECISIONS = {"F32": None, "F16": "fp16", "BF16": "bf16"}


@pytest.fixture
def hooked_slurm(host: Host, receiver: Receiver, secret: str, tmp_path: Path) -> Iterator[SlurmWorker]:
    worker, app = slurm_worker(host, webhook_url=receiver.url,
                               webhook_secret_file=write_secrets(tmp_path / "webhook_secret", secret))
    yield worker
    stop_sender(worker.settings)
    close_worker(worker, app)


def step_lora(job, step: int) -> Path:
    """The step LoRA the job's trainer would write at `step`, as the fake trainer writes one."""
    path = Path(job.output_dir) / f"{job.output_name}-step{step:08d}.safetensors"
    FAKE.save_lora(str(path), job.lora_rank, float(job.lora_rank), {
        "ss_network_dim": str(job.lora_rank), "ss_output_name": job.output_name,
        "ss_max_train_steps": str(job.lora_steps), "ss_seed": str(job.seed), "ss_steps": str(step)},
        precision=PRECISIONS[job.lora_dtype])
    return path


def checkpoint_events(slurm: SlurmWorker, job_id: int) -> list[dict]:
    with slurm.db.reading() as d:
        bodies = [json.loads(body) for _, body in outbox.bodies(d, job_id)]
    return [b["data"]["checkpoint"] for b in bodies if b["type"] == "job.checkpoint"]


def test_a_restarted_poller_reading_the_log_again_sends_no_second_checkpoint_event(hooked_slurm: SlurmWorker):
    slurm = hooked_slurm
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    lora = step_lora(job, 150)
    slurm.log(job, "import network module: networks.lora\n" + steps_bar(0) + steps_bar(150)
              + f"\nsaving checkpoint: {lora}\n" + steps_bar(151))
    slurm.cycles()
    [first] = checkpoint_events(slurm, job.id)
    assert (first["step"], first["path"], first["verified"], first["error"]) == (150, str(lora), True, None)
    slurm.new_poller()  # the first one died: the next reads the node's log from its start
    slurm.log(job, steps_bar(160))
    slurm.cycles(2)
    assert slurm.job(job.id).step == 160
    assert checkpoint_events(slurm, job.id) == [first]
