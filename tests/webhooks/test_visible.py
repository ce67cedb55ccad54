"""What an operator and arbo see of the webhooks: the deliveries route and redeliver, the CLI, /metrics, doctor,
and where the target comes from (the configuration, never a request)."""
from __future__ import annotations

import io
import time
from dataclasses import replace

import pytest

from lora_worker.config import Settings
from lora_worker.errors import ConfigError
from lora_worker.host.nvml import FakeNvml
from lora_worker.ops import doctor
from lora_worker.ops.cli import build_parser
from lora_worker.ops.jobs import run as run_jobs
from lora_worker.webhooks.sender import Sender
from lora_worker.webhooks.signing import load_secrets
from tests.webhooks.jobs import a_finished_job, states
from tests.webhooks.receiver import Answer


def send_everything(settings, db, job_id: int = 1) -> None:
    """Run a sender until the job has nothing pending (a failed attempt is due again 0.1 s later)."""
    sender = Sender(settings, db, load_secrets(settings), rng=lambda: 0.0)
    deadline = time.monotonic() + 10
    while {"pending", "retrying"} & set(states(db, job_id)):
        assert time.monotonic() < deadline
        if sender.cycle() == 0:
            time.sleep(0.02)


def test_deliveries_lists_each_event_and_attempt_and_redeliver_sends_one_again(hooked, hooked_db, receiver,
                                                                              client_for, secret):
    receiver.script = [Answer(500)]
    job_id = a_finished_job(hooked_db)
    sender = Sender(hooked, hooked_db, load_secrets(hooked), rng=lambda: 0.0)
    sender.cycle()  # the first attempt: 500
    client = client_for(replace(hooked, webhook_url=None))  # no sender of the app's own: this test drives it
    listed = client.get(f"/train/{job_id}/deliveries").get_json()
    first = listed["events"][0]
    assert listed["worker_job_id"] == job_id and [e["type"] for e in listed["events"]] == [
        "job.queued", "job.started", "job.succeeded"]
    assert first["state"] == "retrying" and first["attempts"][0]["status_code"] == 500
    assert first["attempts"][0]["error"] == "HTTP 500" and first["attempts"][0]["latency_ms"] >= 0
    send_everything(hooked, hooked_db)
    assert states(hooked_db, job_id) == ["delivered"] * 3
    again = client.post(f"/train/{job_id}/deliveries/{first['event_id']}/redeliver")
    assert again.status_code == 202 and again.get_json()["state"] == "retrying"  # due again, tried before
    assert again.get_json()["next_attempt_at"]
    send_everything(hooked, hooked_db)
    ids = [d.event_id for d in receiver.deliveries]
    assert ids.count(first["event_id"]) == 3 and receiver.deliveries[-1].verified(secret)["type"] == "job.queued"


def test_an_unknown_event_or_job_is_a_404_in_the_error_shape(hooked, hooked_db, client_for):
    job_id = a_finished_job(hooked_db)
    client = client_for(replace(hooked, webhook_url=None))
    missing = client.post(f"/train/{job_id}/deliveries/msg_nope/redeliver")
    assert missing.status_code == 404 and missing.get_json()["error"] == "event_not_found"
    assert missing.get_json()["retryable"] is False
    assert client.get("/train/999/deliveries").get_json()["error"] == "job_not_found"


def test_metrics_count_delivered_retrying_and_given_up_events(hooked, hooked_db, receiver, client_for):
    receiver.script = [Answer(410), Answer(503)]
    a_finished_job(hooked_db)
    sender = Sender(hooked, hooked_db, load_secrets(hooked), rng=lambda: 1.0)
    sender.cycle()  # queued → 410: given up
    sender.cycle()  # started → 503: retrying (not due again for a second)
    text = client_for(replace(hooked, webhook_url=None)).get("/metrics").get_data(as_text=True)
    counts = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("lora_worker_webhook_events{")}
    assert counts == {"pending": 1.0, "retrying": 1.0, "delivered": 0.0, "given_up": 1.0}


def test_jobs_deliveries_prints_each_event_with_its_attempts(hooked, hooked_db, receiver):
    receiver.script = [Answer(502)]
    job_id = a_finished_job(hooked_db)
    send_everything(hooked, hooked_db)
    out = io.StringIO()
    assert run_jobs(hooked, build_parser().parse_args(["jobs", "deliveries", str(job_id)]), out) == 0
    text = out.getvalue()
    assert text.count("delivered") == 3 and "502" in text and "job.succeeded" in text


def test_doctor_says_whether_the_target_answers(hooked, receiver):
    nvml = FakeNvml.from_file(hooked.nvml_fake_file)
    lines = {c.name: c for c in doctor.run_checks(hooked, nvml)}
    assert lines["webhook target"].ok and lines["webhook secret"].ok
    receiver.stop()
    lines = {c.name: c for c in doctor.run_checks(hooked, nvml)}
    assert not lines["webhook target"].ok and "does not answer" in lines["webhook target"].detail


@pytest.mark.parametrize("url", ["ftp://arbo/x", "http:///nohost", "http://user:pw@arbo/x", "arbo:8080"])
def test_a_target_that_is_not_an_http_url_refuses_to_start(url):
    with pytest.raises(ConfigError, match="webhook_url"):
        Settings(webhook_url=url)


def test_unknown_event_types_are_refused_in_the_settings_and_in_a_request(api, migrated, host):
    with pytest.raises(ConfigError, match="webhook_event_types"):
        Settings(webhook_url="http://127.0.0.1:1/x", webhook_event_types="job.queued,job.exploded")
    answer = api.post("/train", json=host.payload(webhook_events=["job.exploded"]))
    assert answer.status_code == 422 and "webhook_events.0" in answer.get_json()["fields"]


def test_a_request_cannot_name_where_events_go(api, host):
    answer = api.post("/train", json=host.payload(webhook_url="http://attacker.example/x"))
    assert answer.status_code == 422 and "webhook_url" in answer.get_json()["fields"]
